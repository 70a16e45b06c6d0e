"""Startup checks: deduplication is never off without a word.

``import celery_dedup`` connects them (Celery signals), so nothing is to be
called by hand:

* **at worker start** (``celeryd_after_setup`` for ``celery worker``, just
  before its banner; ``worker_init`` for a worker embedded with
  ``WorkController``/``start_worker``), an app with at least one
  ``DedupTask`` probes its lock store with one acquire/release round trip.
  A store that cannot be reached, or no store at all, is logged as an ERROR
  block naming the store URL (secrets masked) and what calls will do
  (``dedup_fallback``); the ``celery worker`` banner gets a
  ``[celery-dedup]`` line with the verdict either way;
* **dedup options where nothing reads them**: a task without ``DedupTask``
  defining ``unique_for``, ``unique_until``, ``deduplication_key``,
  ``identity``, ``unique_on``, ``on_duplicate`` or ``deterministic_id``
  (checked when its app is finalized and at worker start), or a call of such
  a task (``apply_async``, ``send_task``) passing one of them (checked in
  ``before_task_publish``), warns once per task with a
  ``DedupConfigWarning`` naming the task and the options.

``probe_store`` and ``task_plans`` are what ``celery dedup check``,
``manage.py dedup_locks check`` and the Django system check report.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from celery._state import connect_on_app_finalize, get_current_app
from celery.signals import before_task_publish, celeryd_after_setup, worker_init
from kombu.utils.url import maybe_sanitize_url

from .app_urls import broker_url, result_backend
from .events import warn_if_events_off
from .exceptions import InvalidOptionError
from .identity import lock_key
from .limits import Limits, OnRateLimit, Rate, limits_of
from .lint import Finding, TaskFacts, app_facts, lint_config, lint_server, task_facts
from .options import DedupConfigWarning
from .registry import TASK_NAMES
from .runtime import runtime_for
from .stores import derive_store_url
from .stores.base import Durability, DurabilityReport
from .task import DedupTask

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "DEDUP_OPTIONS",
    "PROBE_OWNER_PREFIX",
    "PROBE_TIMEOUT",
    "StoreProbe",
    "TaskPlan",
    "check_worker_start",
    "dedup_tasks",
    "lint_app",
    "lint_tasks",
    "plain_tasks_with_options",
    "probe_store",
    "store_durability",
    "task_plans",
    "warn_plain_task_options",
]

logger = logging.getLogger("celery_dedup")

#: the names only a ``DedupTask`` reads (as task attributes or call options)
#: the task attributes a plain (non-``DedupTask``) task sets for nothing (``registry``)
DEDUP_OPTIONS: Final = TASK_NAMES

#: seconds the start probe waits for the store before calling it unreachable
PROBE_TIMEOUT: Final = 10.0

#: the task name the probe's lock key is made under (never a real task's)
_PROBE_TASK: Final = "celery_dedup.check"

#: how the probe's owner tokens start, so lock scans can tell its short-lived lock
PROBE_OWNER_PREFIX: Final = "probe:"

#: modules whose task classes read some of these names for themselves
_OTHER_LIBRARIES: Final = ("celery_once", "celery_singleton")

W_PLAIN_TASK = (
    "celery-dedup: task {task} sets {options} but is not a DedupTask, so nothing "
    "deduplicates it: the option{s} {are} ignored. Define it with "
    "@app.task(base=DedupTask, ...) (from celery_dedup import DedupTask)."
)
W_PLAIN_CALL = (
    "celery-dedup: a call of {task} passes {options}, but {task} is not a DedupTask "
    "(or is sent by name), so nothing deduplicates it: Celery publishes the "
    "option{s} as message properties and ignores {them}. Define it with "
    "@app.task(base=DedupTask, ...)."
)
E_BANNER_BLOCK = """
-------------- celery-dedup: DEDUPLICATION IS NOT WORKING --------------
{problem}
Tasks affected: {tasks}
What their calls do now: {effect}
Check it with: celery -A <app> dedup check
------------------------------------------------------------------------"""


@dataclass(frozen=True)
class StoreProbe:
    """The outcome of one acquire/release round trip on an app's lock store."""

    #: the store URL, secrets masked (``None``: no store can be derived)
    url: str | None
    #: the store's short name (``redis``, ``sql``, ``django-db``…), when built
    store: str | None
    #: whether a lock was taken and released
    ok: bool
    #: what went wrong, in words (``None`` when ``ok``)
    error: str | None = None
    #: seconds the round trip took
    elapsed: float = 0.0

    def describe(self) -> str:
        """One line: ``redis store at redis://…: OK (3 ms)`` or the error."""
        where = f"{self.store or 'lock'} store at {self.url}" if self.url else "no lock store"
        if self.ok:
            return f"{where}: OK (acquire/release round trip in {self.elapsed * 1000:.0f} ms)"
        return f"{where}: {self.error}"


@dataclass(frozen=True)
class TaskPlan:
    """What one registered ``DedupTask`` would use for a call passing no options."""

    name: str
    store: str
    unique_until: str
    unique_for: float
    identity: str
    on_duplicate: str
    #: an option error found while resolving (``None`` when valid)
    error: str | None = None
    #: its per-key limits in words (``"concurrency 2 per '{account}'"``), ``""`` for none
    limits: str = ""


def _registered(app: Celery) -> dict[str, Any]:
    """``app.tasks``; empty for an app built with ``autofinalize=False`` not finalized yet."""
    # Not in the type stubs: Celery sets both in ``__init__``.
    if not getattr(app, "finalized", False) and not getattr(app, "autofinalize", True):
        return {}
    return dict(app.tasks)


def dedup_tasks(app: Celery) -> list[DedupTask]:
    """The ``DedupTask`` instances registered on ``app``, by name."""
    found = [task for task in _registered(app).values() if isinstance(task, DedupTask)]
    return sorted(found, key=lambda task: task.name)


def masked_url(url: str) -> str:
    """``url`` with its password masked, also when kombu cannot parse it.

    A memcached URL naming several servers (``memcached://h1:1;h2:2``) has
    no single port, which kombu's parser refuses.
    """
    try:
        return str(maybe_sanitize_url(url))
    except ValueError:
        return re.sub(r"(//[^:/@;]*):[^@/;]*@", r"\1:**@", url)


def probe_store(app: Celery, timeout: float = PROBE_TIMEOUT) -> StoreProbe:
    """Take and release one lock on ``app``'s store; never raises.

    The lock lives under a random key of its own, for at most a minute if the
    release is lost. Gives up after ``timeout`` seconds (a store behind a
    firewall that drops packets never answers).
    """
    url = derive_store_url(app)
    shown = masked_url(url) if url else None
    outcome: list[StoreProbe] = []

    def run() -> None:
        started = time.monotonic()
        name: str | None = None
        try:
            store = runtime_for(app).store
            if store is None:
                outcome.append(StoreProbe(shown, None, False, _no_store(app)))
                return
            name = store.name
            key = lock_key(runtime_for(app).settings.key_prefix, _PROBE_TASK, secrets.token_hex())
            owner = PROBE_OWNER_PREFIX + secrets.token_hex(16)
            meta = {"task_name": _PROBE_TASK, "policy": "expiry", "task_id": owner}
            holder = store.acquire(key, owner, 60.0, meta)
            if holder is not None:
                outcome.append(StoreProbe(shown, name, False, "the probe's fresh key was held"))
                return
            if not store.release(key, owner):
                outcome.append(
                    StoreProbe(shown, name, False, "the probe's lock could not be released")
                )
                return
            outcome.append(StoreProbe(shown, name, True, None, time.monotonic() - started))
        except Exception as exc:  # any failure is the answer, reported in words
            outcome.append(StoreProbe(shown, name, False, f"{type(exc).__name__}: {exc}"))
        finally:
            _close_thread_connections()

    thread = threading.Thread(target=run, name="celery-dedup-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return StoreProbe(shown, None, False, f"no answer within {timeout:g} s")
    return outcome[0]


def _close_thread_connections() -> None:
    """Django's connections are per thread: the probe's own must not outlive it."""
    db = sys.modules.get("django.db")  # only when a Django store loaded it
    if db is not None:
        with contextlib.suppress(Exception):  # Django not configured: nothing was opened
            db.connections.close_all()


def _no_store(app: Celery) -> str:
    return (
        "no lock store can be derived from this app (result backend "
        f"{_scheme(result_backend(app.conf))}, broker "
        f"{_scheme(broker_url(app.conf))}) and dedup_store is not set"
    )


def _scheme(url: Any) -> str:
    text = str(url or "")
    return f"{text.partition('://')[0]}://" if "://" in text else (text or "none")


def _fallback_effect(app: Celery, probe: StoreProbe) -> str:
    fallback = app.conf.get("dedup_fallback")
    if probe.url is None and fallback is None:
        return "they raise ImproperlyConfigured and publish nothing (set dedup_store)"
    if (fallback or "open") == "closed":
        return ("they raise DeduplicationUnavailable and publish nothing "
                "(dedup_fallback='closed')")
    return ("they are published WITHOUT deduplication, so the same work can run twice "
            "(dedup_fallback='open')")


def task_plans(app: Celery) -> list[TaskPlan]:
    """What each registered ``DedupTask`` would use: store, policy, TTL; never raises."""
    url = derive_store_url(app)
    store = masked_url(url) if url else "none"
    plans = []
    for task in dedup_tasks(app):
        try:
            config = task.dedup_config()
            limits = limits_in_words(limits_of(task))
        except Exception as exc:  # an invalid option is reported, not raised
            plans.append(TaskPlan(task.name, store, "?", 0.0, "?", "?", str(exc)))
            continue
        plans.append(TaskPlan(
            name=task.name,
            store=store,
            unique_until=config.unique_until.value,
            unique_for=config.unique_for,
            identity=config.identity.value,
            on_duplicate=config.on_duplicate.value,
            limits=limits,
        ))
    return plans


def _key_words(spec: Any) -> str:
    if spec is None:
        return "per dedup key"
    if isinstance(spec, str):
        return f"per {spec!r}"
    return f"per {getattr(spec, '__name__', 'callable')}()"


def _limit_words(spec: Any) -> str:
    if callable(spec):
        return f"{getattr(spec, '__name__', 'callable')}()"
    return str(spec)


def limits_in_words(limits: Limits | None) -> str:
    """A task's ``concurrency_limit``/``rate_limit_per_key`` as ``check`` shows them."""
    if limits is None:
        return ""
    words = []
    if limits.concurrency is not None:
        value = _limit_words(limits.concurrency)
        words.append(f"concurrency {value} {_key_words(limits.concurrency_key)}")
    if limits.rate is not None:
        if isinstance(limits.rate, Rate):
            period = {1.0: "s", 60.0: "m", 3600.0: "h", 86400.0: "d"}[limits.rate.period]
            value = f"{limits.rate.limit}/{period}"
        else:
            value = _limit_words(limits.rate)
        delay = ", delay" if limits.on_rate_limit is OnRateLimit.DELAY else ""
        words.append(f"rate {value} {_key_words(limits.rate_key)}{delay}")
    return "; ".join(words)


# -- the settings lint --------------------------------------------------------------


def store_durability(app: Celery, timeout: float = PROBE_TIMEOUT) -> Durability | None:
    """Ask ``app``'s store's server whether it keeps keys until their TTL; never raises.

    ``None`` when the store cannot be asked at all (no ``DurabilityReport``).
    The answer is kept for the settings lint of each task's first call.
    """
    outcome: list[Durability | None] = []

    def run() -> None:
        try:
            store = runtime_for(app).store
            outcome.append(store.durability() if isinstance(store, DurabilityReport) else None)
        except Exception as exc:  # the answer is "cannot tell", in words
            outcome.append(Durability(None, None, None, f"{type(exc).__name__}: {exc}"))

    thread = threading.Thread(target=run, name="celery-dedup-durability", daemon=True)
    thread.start()
    thread.join(timeout)
    found = outcome[0] if outcome else Durability(
        None, None, None, f"no answer within {timeout:g} s")
    runtime_for(app).durability = found
    return found


def lint_tasks(app: Celery) -> list[TaskFacts]:
    """``TaskFacts`` of each ``DedupTask`` of ``app`` whose options are valid.

    A task whose options are invalid is left out: ``task_plans`` (and the
    option checks) report its error.
    """
    tasks = []
    for task in dedup_tasks(app):
        try:
            tasks.append(task_facts(task))
        except Exception:  # an invalid option is reported by task_plans
            continue
    return tasks


def lint_app(
    app: Celery, *, ask_server: bool = True, timeout: float = PROBE_TIMEOUT
) -> list[Finding]:
    """The settings lint of every ``DedupTask`` of ``app`` (``celery_dedup.lint``).

    With ``ask_server`` the store's server is asked too (one round trip, at
    most ``timeout`` seconds).
    """
    try:
        facts = app_facts(app)
    except InvalidOptionError:  # reported by the option checks and task_plans
        return []
    tasks = lint_tasks(app)
    found = lint_config(facts, tasks)
    if ask_server:
        found += lint_server(facts, tasks, store_durability(app, timeout))
    runtime_for(app).linted.update(["", *(task.name for task in tasks)])
    return found


# -- dedup options where nothing reads them ----------------------------------------


def _from_other_library(task: Any) -> bool:
    return any(cls.__module__.startswith(_OTHER_LIBRARIES) for cls in type(task).__mro__)


def plain_tasks_with_options(app: Celery) -> dict[str, tuple[str, ...]]:
    """Tasks of ``app`` that are not ``DedupTask`` but set dedup options: name → options."""
    found = {}
    for name, task in _registered(app).items():
        if isinstance(task, DedupTask) or _from_other_library(task):
            continue
        given = tuple(o for o in DEDUP_OPTIONS if getattr(task, o, None) is not None)
        if given:
            found[name] = given
    return found


def _warned_for(app: Any) -> set[str]:
    warned: set[str] = app.__dict__.setdefault("_celery_dedup_plain_warned", set())
    return warned


def _warn(template: str, task: str, options: Iterable[str], warned: set[str]) -> None:
    if task in warned:
        return
    warned.add(task)
    names = sorted(options)
    many = len(names) > 1
    warnings.warn(
        template.format(
            task=task, options=", ".join(names), s="s" if many else "",
            are="are" if many else "is", them="them" if many else "it",
        ),
        DedupConfigWarning,
        stacklevel=3,
    )


def warn_plain_task_options(app: Celery) -> dict[str, tuple[str, ...]]:
    """Warn once per task about dedup options on tasks that are not ``DedupTask``."""
    found = plain_tasks_with_options(app)
    warned = _warned_for(app)
    for name, options in found.items():
        _warn(W_PLAIN_TASK, name, options, warned)
    return found


@before_task_publish.connect(weak=False, dispatch_uid="celery_dedup.plain_call")
def _check_plain_call(
    sender: str | None = None, properties: Mapping[str, Any] | None = None, **_: Any
) -> None:
    """A ``DedupTask`` pops its options before publishing: any left here went nowhere."""
    if not properties:
        return
    given = [name for name in DEDUP_OPTIONS if name in properties]
    if given:
        _warn(W_PLAIN_CALL, str(sender), given, _warned_for(get_current_app()))


def _lint_after_finalize(app: Celery) -> None:
    app.on_after_finalize.connect(_on_after_finalize, weak=False,
                                  dispatch_uid="celery_dedup.lint")


def _on_after_finalize(sender: Celery, **_: Any) -> None:
    warn_plain_task_options(sender)


connect_on_app_finalize(_lint_after_finalize)


# -- the worker-start probe --------------------------------------------------------


def check_worker_start(app: Celery, worker: Any = None) -> StoreProbe | None:
    """Probe the store of ``app`` and say so loudly when deduplication will not work.

    Returns the probe (``None`` when the app has no ``DedupTask``). Logs an
    ERROR block when the store is unusable, INFO when it works; a warning when
    ``worker`` sends task events but deduplicated calls are not reported;
    with a ``celery worker`` instance, adds a ``[celery-dedup]`` line to its
    banner.
    """
    warn_plain_task_options(app)
    tasks = dedup_tasks(app)
    if not tasks:
        return None
    warn_if_events_off(bool(getattr(worker, "task_events", False)),
                       runtime_for(app).settings.send_events)
    probe = probe_store(app)
    found = lint_app(app, ask_server=probe.ok)
    for finding in found:
        logger.warning("%s", finding.line())
    if probe.ok:
        logger.info("celery-dedup: %s", probe.describe())
        verdict = f"[celery-dedup] {len(tasks)} task(s), {probe.describe()}"
        if found:
            ids = ", ".join(sorted({finding.id for finding in found}))
            verdict += f"\n[celery-dedup] settings lint: {ids} (see the log)"
    else:
        names = ", ".join(task.name for task in tasks[:5])
        more = f" and {len(tasks) - 5} more" if len(tasks) > 5 else ""
        logger.error(E_BANNER_BLOCK.format(
            problem=f"The lock store is unusable: {probe.describe()}.",
            tasks=names + more,
            effect=_fallback_effect(app, probe),
        ))
        verdict = f"[celery-dedup] LOCK STORE UNUSABLE: {probe.describe()}"
    if worker is not None and hasattr(worker, "extra_info"):
        _add_to_banner(worker, verdict)
    return probe


def _add_to_banner(worker: Any, line: str) -> None:
    """Append ``line`` to the ``celery worker`` banner (its ``extra_info`` section)."""
    original = worker.extra_info

    def extra_info() -> str:
        return f"{original() or ''}\n{line}\n"

    worker.extra_info = extra_info


@celeryd_after_setup.connect(weak=False, dispatch_uid="celery_dedup.worker_start")
def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """``celery worker``: logging is set up and the banner comes next."""
    if instance is not None:
        check_worker_start(instance.app, instance)


@worker_init.connect(weak=False, dispatch_uid="celery_dedup.worker_init")
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """An embedded worker (``WorkController``); ``celery worker`` is checked after setup."""
    from celery.apps.worker import Worker

    if sender is not None and not isinstance(sender, Worker):
        check_worker_start(sender.app, sender)
