"""System checks (``manage.py check``) for the ``CELERY_DEDUP_*`` settings.

Each invalid setting is reported with its own id, a message naming the
setting, its value and the allowed values (from the same validators the task
uses), and a hint. Settings come from Django settings (``CELERY_DEDUP_*``,
the ``namespace="CELERY"`` convention) and from the Celery app's ``app.conf``
(values set in code, which win over Django settings).

======================  ===============================================
id                      setting
======================  ===============================================
``celery_dedup.E001``   ``CELERY_DEDUP_STORE``
``celery_dedup.E002``   ``CELERY_DEDUP_KEY_PREFIX``
``celery_dedup.E003``   ``CELERY_DEDUP_DEFAULT_TTL``
``celery_dedup.E004``   ``CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL``
``celery_dedup.E005``   ``CELERY_DEDUP_DEFAULT_IDENTITY``
``celery_dedup.E006``   ``CELERY_DEDUP_DEFAULT_ON_DUPLICATE``
``celery_dedup.E007``   ``CELERY_DEDUP_FALLBACK``
``celery_dedup.E008``   ``CELERY_DEDUP_SEND_EVENTS``
``celery_dedup.E009``   ``CELERY_DEDUP_STORE`` names an unknown scheme
``celery_dedup.E010``   ``CELERY_DEDUP_STORE_OPTIONS`` is not a mapping
``celery_dedup.E011``   ``CELERY_DEDUP_METRICS_FLUSH_INTERVAL``
``celery_dedup.E012``   ``CELERY_DEDUP_NATIVE``
``celery_dedup.E013``   ``CELERY_DEDUP_REVOKED_TTL``
``celery_dedup.E014``   no lock store can be derived and
                        ``CELERY_DEDUP_FALLBACK`` is not set
``celery_dedup.E015``   the lock store failed an acquire/release round
                        trip (a ``database``-tagged check: run by
                        ``manage.py check --database default`` and
                        ``migrate``, never by a plain ``check``)
``celery_dedup.E016``   the store cannot be built as a call would build it
                        (a ``DATABASES``/``CACHES`` alias that does not
                        exist, a ``DummyCache``, the app not installed)
``celery_dedup.E017``   a ``DedupTask``'s options are invalid (every call
                        of it would fail)
``celery_dedup.W001``   an unknown ``CELERY_DEDUP_*`` setting (a typo?)
``celery_dedup.W010``   the store is a Django cache without compare-and-set
                        (best effort owner checks)
``celery_dedup.W011``   the store is a ``LocMemCache`` (one process only)
``celery_dedup.W012``   no lock store, but the broker is SQS and
                        ``CELERY_DEDUP_NATIVE`` is ``auto``: calls to
                        ``.fifo`` queues deduplicate natively, others fail
``celery_dedup.W020``   a task that is not a ``DedupTask`` sets dedup
                        options (nothing reads them)
``celery_dedup.W021``   the Celery app's task modules cannot be imported
``celery_dedup.E032``   ``CELERY_DEDUP_SILENCED_WARNINGS``
``celery_dedup.E042``   ``CELERY_DEDUP_MODE``
``celery_dedup.W101``…  the settings lint (``celery_dedup.lint``): W101,
``celery_dedup.W109``   W108, W109 and the store-type cases of W107
                        once the Celery app is finalized; W106/I106 and
                        the Redis cases of W107/I107 ask the store's
                        server (``database`` tag, with E015)
======================  ===============================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, Final, cast

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Warning

from ...app_urls import broker_url, result_backend
from ...exceptions import ImproperlyConfigured, InvalidOptionError
from ...lint import Finding
from ...native import Native
from ...options import KNOWN_SETTINGS, SETTINGS, did_you_mean
from ...stores import ALIASES, ENTRY_POINT_GROUP, derive_store_url, split_url, store_from_url

__all__ = [
    "CHECK_IDS",
    "as_check",
    "check_settings",
    "check_store",
    "check_tasks",
    "django_setting_name",
]

#: ``dedup_*`` setting → check id of its "invalid value" error.
CHECK_IDS: Final[Mapping[str, str]] = {
    "dedup_store": "celery_dedup.E001",
    "dedup_key_prefix": "celery_dedup.E002",
    "dedup_default_ttl": "celery_dedup.E003",
    "dedup_default_unique_until": "celery_dedup.E004",
    "dedup_default_identity": "celery_dedup.E005",
    "dedup_default_on_duplicate": "celery_dedup.E006",
    "dedup_fallback": "celery_dedup.E007",
    "dedup_send_events": "celery_dedup.E008",
    "dedup_metrics_flush_interval": "celery_dedup.E011",
    "dedup_native": "celery_dedup.E012",
    "dedup_revoked_ttl": "celery_dedup.E013",
    "dedup_lease_ttl": "celery_dedup.E030",
    "dedup_done_ttl": "celery_dedup.E031",
    "dedup_silenced_warnings": "celery_dedup.E032",
    "dedup_on_key_reuse": "celery_dedup.E040",
    "dedup_cancel_wait": "celery_dedup.E036",
    "dedup_cancel_signal": "celery_dedup.E037",
    "dedup_retry_window": "celery_dedup.E041",
    "dedup_mode": "celery_dedup.E042",
}
E_UNKNOWN_SCHEME: Final = "celery_dedup.E009"
E_STORE_OPTIONS: Final = "celery_dedup.E010"
E_NO_STORE: Final = "celery_dedup.E014"
E_STORE_UNUSABLE: Final = "celery_dedup.E015"
E_STORE_UNBUILDABLE: Final = "celery_dedup.E016"
E_TASK_OPTIONS: Final = "celery_dedup.E017"
W_PLAIN_TASK: Final = "celery_dedup.W020"
W_TASKS_UNIMPORTABLE: Final = "celery_dedup.W021"
W_UNKNOWN_SETTING: Final = "celery_dedup.W001"
W_BEST_EFFORT_CACHE: Final = "celery_dedup.W010"
W_LOCMEM_CACHE: Final = "celery_dedup.W011"
W_NATIVE_ONLY: Final = "celery_dedup.W012"

#: every setting celery-dedup reads
KNOWN: Final = KNOWN_SETTINGS

_NAMESPACE: Final = "CELERY_"


def django_setting_name(name: str) -> str:
    """``dedup_default_ttl`` → ``CELERY_DEDUP_DEFAULT_TTL``."""
    return _NAMESPACE + name.upper()


def _given() -> Iterator[tuple[str, str, Any]]:
    """``(dedup_* name, where it was set, value)`` for every dedup setting given."""
    seen: dict[str, Any] = {}
    for attr in sorted(set(dir(settings))):
        if attr.startswith(_NAMESPACE + "DEDUP_"):
            name = attr[len(_NAMESPACE) :].lower()
            seen[name] = getattr(settings, attr)
            yield name, attr, seen[name]
    conf = _app_conf()
    if conf is None:
        return
    for name in sorted(KNOWN):
        value = conf.get(name)
        if value is not None and (name not in seen or seen[name] != value):
            yield name, f"app.conf.{name}", value


def _app() -> Any:
    """The current Celery app, or ``None`` if its configuration cannot be read."""
    from celery import current_app

    try:
        broker_url(current_app.conf)
    except Exception:  # a broken Celery config is reported by Celery itself
        return None
    # The app itself, not the proxy: the probe runs in a thread of its own,
    # where the proxy would resolve to the default app.
    return cast(Any, current_app)._get_current_object()


def _app_conf() -> Any:
    """The current Celery app's configuration, or ``None`` if it cannot be read."""
    app = _app()
    return None if app is None else app.conf


def _check_store_derivable() -> Error | Warning | None:
    """No store can be derived and the user did not opt into publishing without one."""
    app = _app()
    if app is None or app.conf.get("dedup_fallback") is not None:
        return None
    try:
        if derive_store_url(app) is not None:
            return None
    except Exception:  # an invalid dedup_store is reported by E001/E009
        return None
    broker = broker_url(app.conf)
    native = str(app.conf.get("dedup_native") or Native.AUTO.value)
    if split_url(broker)[0] == "sqs" and native == Native.AUTO.value:
        # Calls to .fifo queues need no store: not a reason to block migrate/runserver.
        return Warning(
            "celery-dedup has no lock store: calls routed to SQS FIFO (.fifo) queues "
            "deduplicate natively, but a DedupTask call to any other queue would fail with "
            "ImproperlyConfigured",
            hint="Route deduplicated tasks to .fifo queues only, or set CELERY_DEDUP_STORE.",
            id=W_NATIVE_ONLY,
        )
    backend = result_backend(app.conf) or "none"
    return Error(
        "celery-dedup has no lock store: none can be derived from the result backend "
        f"({str(backend).partition('://')[0]}) or the broker, and CELERY_DEDUP_STORE is "
        "not set; every DedupTask call would fail with ImproperlyConfigured",
        hint="Set CELERY_DEDUP_STORE to a redis://, db+…, django-db or memcached:// URL "
        "(or use such a result backend); or set CELERY_DEDUP_FALLBACK = 'open' to publish "
        "without deduplication.",
        id=E_NO_STORE,
    )


def _check_one(name: str, where: str, value: Any) -> Error | None:
    if name == "dedup_store_options":
        if value is not None and not isinstance(value, Mapping):
            return Error(
                f"{where}={value!r} is not valid; expected a dict of store options",
                hint="Pass keyword arguments of the store's client, e.g. {'socket_timeout': 1}.",
                id=E_STORE_OPTIONS,
            )
        return None
    if name == "dedup_store" and value == "":
        return None  # as at run time: empty means "derive it from the result backend"
    validate = SETTINGS[name][1]
    try:
        validate(value, where)
    except InvalidOptionError as exc:
        return Error(
            str(exc),
            hint=f"Set {where} to {exc.allowed}, or remove it to use the default "
            f"({_default(name)!r}).",
            id=CHECK_IDS[name],
        )
    if name == "dedup_store" and value:
        return _check_scheme(where, value)
    return None


def _default(name: str) -> Any:
    default = SETTINGS[name][0]
    return getattr(default, "value", default)


def _check_scheme(where: str, url: str) -> Error | None:
    alias, _ = split_url(url)
    plugins = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if alias in ALIASES or alias in plugins:
        return None
    known = ", ".join(sorted({*ALIASES, *plugins}))
    return Error(
        f"{where} uses the unknown lock store scheme {alias!r}",
        hint=f"Use one of: {known}; or register a store under the {ENTRY_POINT_GROUP!r} "
        "entry-point group.",
        id=E_UNKNOWN_SCHEME,
    )


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Report every invalid or unknown celery-dedup setting."""
    messages: list[CheckMessage] = []
    for name, where, value in _given():
        if name not in KNOWN:
            close = did_you_mean(name, KNOWN)
            hint = (
                f"Did you mean {django_setting_name(close)}?"
                if close
                else "Known settings: " + ", ".join(sorted(map(django_setting_name, KNOWN)))
            )
            messages.append(
                Warning(f"{where} is not a celery-dedup setting", hint=hint, id=W_UNKNOWN_SETTING)
            )
            continue
        error = _check_one(name, where, value)
        if error is not None:
            messages.append(error)
    no_store = _check_store_derivable()
    if no_store is not None:
        messages.append(no_store)
    unusable = _check_store_builds()
    if unusable is not None:
        messages.append(unusable)
        return messages
    cache = _check_cache_store()
    if cache is not None:
        messages.append(cache)
    return messages


def _check_store_builds() -> Error | None:
    """A Django store (``django-db``, ``django-cache``) that a call could not build.

    Built exactly as the first call builds it (``store_from_url``), which
    checks the alias, the backend and the installed app without touching the
    database or the cache, so the check and the call agree.
    """
    app = _app()
    try:
        url = derive_store_url(app) if app is not None else None
    except Exception:  # an invalid dedup_store is reported by E001/E009
        return None
    if url is None or split_url(url)[0] not in ("django-db", "django-cache"):
        return None
    options = app.conf.get("dedup_store_options")
    try:
        store_from_url(url, app=app, options=options if isinstance(options, Mapping) else None)
    except ImproperlyConfigured as exc:
        return Error(
            f"celery-dedup cannot use its lock store {url!r}: {exc}",
            hint="Fix the alias or backend; every DedupTask call would fail with this error.",
            id=E_STORE_UNBUILDABLE,
        )
    return None


def _check_cache_store() -> Warning | None:
    """A ``django-cache`` store on a backend that cannot hold the lock contract."""
    app = _app()
    try:
        url = derive_store_url(app) if app is not None else None
    except Exception:  # an invalid dedup_store is reported by E001/E009
        return None
    if url is None or split_url(url)[0] != "django-cache":
        return None
    from django.conf import settings as django_settings

    from ...stores.django_cache import CacheGuarantee, DjangoCacheStore

    alias = url.partition("://")[2] or "default"
    if alias not in django_settings.CACHES:
        return None
    backend = django_settings.CACHES[alias].get("BACKEND", "?")
    guarantee = DjangoCacheStore(alias).guarantee()
    if guarantee is CacheGuarantee.BEST_EFFORT:
        return Warning(
            f"CELERY_DEDUP_STORE uses cache {alias!r} ({backend}), which has no "
            "compare-and-set: release, extend, take-over, the start check and revoke are "
            "best effort (a late caller can free or overwrite a lock re-taken at the end "
            "of its TTL)",
            hint="Use a PyMemcacheCache or RedisCache cache, or django-db.",
            id=W_BEST_EFFORT_CACHE,
        )
    if guarantee is CacheGuarantee.ATOMIC_IN_PROCESS:
        return Warning(
            f"CELERY_DEDUP_STORE uses cache {alias!r}, a LocMemCache: its locks live in "
            "one process, so producers and workers in other processes never see them",
            hint="Use a shared cache (PyMemcacheCache, RedisCache), or django-db.",
            id=W_LOCMEM_CACHE,
        )
    return None


def check_store(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """One acquire/release round trip on the lock store (``database`` tag).

    Django runs database checks only when asked (``check --database``,
    ``migrate``), so ``runserver`` and test runs never wait for a store.
    """
    if not databases:
        return []
    app = _app()
    try:
        url = derive_store_url(app) if app is not None else None
    except Exception:  # an invalid dedup_store is reported by E001/E009
        return []
    if app is None or url is None:
        return []  # no store at all is E014's
    if split_url(url)[0] == "django-db" and not _lock_table_exists(url):
        return []  # `migrate` (which runs this check first) creates it
    from ...startup import probe_store

    probe = probe_store(app)
    if probe.ok:
        from ...lint import app_facts, lint_server
        from ...startup import lint_tasks, store_durability

        try:
            facts = app_facts(app)
        except InvalidOptionError:  # E032 says so
            return []
        server = store_durability(app)
        return [as_check(found) for found in lint_server(facts, lint_tasks(app), server)]
    return [Error(
        f"celery-dedup's lock store is unusable: {probe.describe()}; DedupTask calls "
        "will follow CELERY_DEDUP_FALLBACK (open: published WITHOUT deduplication)",
        hint="Start the store or fix CELERY_DEDUP_STORE (or the result backend it is "
        "derived from); `manage.py dedup_locks check` shows what each task would use.",
        id=E_STORE_UNUSABLE,
    )]


def _lock_table_exists(url: str) -> bool:
    """Whether the django-db store's table exists yet in its database."""
    from django.db import connections

    from .models import DedupLock

    alias = url.partition("://")[2] or "default"
    try:
        with connections[alias].cursor() as cursor:
            tables = connections[alias].introspection.table_names(cursor)
    except Exception:  # an unreachable database: let the probe say so
        return True
    return bool(DedupLock._meta.db_table in tables)


def as_check(finding: Finding) -> CheckMessage:
    """A lint finding as a Django check message (``celery_dedup.W101``…)."""
    kind = Info if finding.is_info else Warning
    return kind(finding.message, hint=finding.hint, obj=finding.task,
                id=f"celery_dedup.{finding.id}")


def check_tasks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What ``dedup_locks check`` finds in the tasks, as system checks.

    Imports the Celery app's task modules first (as a worker does at start:
    Celery's Django layout imports them lazily), then reports each
    ``DedupTask`` whose options are invalid (E017), each task that is not a
    ``DedupTask`` but sets dedup options nothing reads (W020), and the
    settings lint (W101…). Celery's Django fixup runs the system checks
    while it imports those modules; that nested run reports nothing (the
    outer one does). A task module that fails to import is W021.
    """
    app = _app()
    if app is None:
        return []
    from .discovery import import_task_modules

    if not app.finalized and not getattr(app, "autofinalize", True):
        return []  # the project finalizes it itself, when it is ready
    try:
        if not import_task_modules(app):
            return []
    except Exception as exc:  # the worker fails the same way; say so, do not crash check
        return [Warning(
            f"celery-dedup could not import the Celery app's task modules to check "
            f"them: {exc!r}",
            hint="A worker fails to start the same way; fix the import.",
            id=W_TASKS_UNIMPORTABLE,
        )]
    try:
        _finalize(app)
    except Exception as exc:  # an option a task's registration refused
        return [Error(
            f"the Celery app's tasks cannot be registered: {exc}",
            hint="A worker fails to start with this error, and every call of the task "
            "fails with it; fix the option.",
            id=E_TASK_OPTIONS,
            obj=getattr(exc, "task_name", None),
        )]
    from ...lint import app_facts, lint_config
    from ...startup import lint_tasks, plain_tasks_with_options

    try:
        facts = app_facts(app)
    except InvalidOptionError:  # E032 says so
        facts = None
    invalid = [
        Error(
            f"task {plan.name}: {plan.error}",
            hint="Every call of this task would fail with this error; fix the option.",
            id=E_TASK_OPTIONS,
            obj=plan.name,
        )
        for plan in _plans(app) if plan.error
    ]
    lint = [] if facts is None else [
        as_check(found) for found in lint_config(facts, lint_tasks(app))]
    return invalid + lint + [
        Warning(
            f"task {name} sets {', '.join(options)} but is not a DedupTask: nothing "
            "deduplicates it and the options are ignored",
            hint="Define it with @shared_task(base=DedupTask, ...) "
            "(from celery_dedup import DedupTask).",
            id=W_PLAIN_TASK,
            obj=name,
        )
        for name, options in plain_tasks_with_options(app).items()
    ]


def _plans(app: Any) -> list[Any]:
    """``task_plans``; none when the store URL itself is invalid (E001/E009 say so)."""
    from ...startup import task_plans

    try:
        return list(task_plans(app))
    except Exception:
        return []


def _finalize(app: Any) -> None:
    """``app.finalize()``; on an error the app is left unfinalized, as before.

    Celery marks the app finalized before it registers the tasks: a task
    whose registration raises would otherwise leave the others unregistered
    for good, in a process (a worker starting: Celery's Django fixup
    ignores what the checks return) that would then run without them
    instead of failing at its own finalize.
    """
    if app.finalized:
        return
    try:
        app.finalize()
    except Exception:
        app.finalized = False
        raise
