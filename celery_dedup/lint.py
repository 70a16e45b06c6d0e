"""The settings lint: settings that let duplicates or lost work through.

Pure rules over what a configuration says: the app's settings
(``AppFacts``), each ``DedupTask``'s options (``TaskFacts``) and, for the
rules only a server can decide, what the store's server says about keeping
keys (``stores.base.Durability``). Each rule yields ``Finding``s with an id
(``W1xx``; ``I1xx`` when it cannot be decided without the server), a
message and a one-line fix. Four entry points report them: the worker's
start (``celery_dedup.startup``), the first call of each task in a process
(``DedupTask.apply_async``), Django's ``manage.py check``
(``celery_dedup.W1xx``) and ``celery dedup check``.

A finding is silenced for one task by its ``dedup_silenced`` attribute
(``dedup_silenced=("W101",)``) and for the whole app by the
``dedup_silenced_warnings`` setting; Django's ``SILENCED_SYSTEM_CHECKS``
silences the ``celery_dedup.W1xx`` ids of ``manage.py check``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from .options import validate_lint_ids
from .policy import UniqueUntil
from .stores import derive_store_url, split_url
from .stores.base import Durability

__all__ = [
    "RETIRED",
    "RULES",
    "SERVER_RULES",
    "AppFacts",
    "Finding",
    "Rule",
    "TaskFacts",
    "app_facts",
    "lint_config",
    "lint_countdown",
    "lint_server",
    "task_facts",
]


@dataclass(frozen=True)
class Rule:
    """One lint id: what it means and the one-line fix."""

    id: str
    title: str
    fix: str


#: ids no longer reported (still accepted when silenced, so old settings keep working)
RETIRED: Final = frozenset({"W102", "W103", "W104", "W105"})

#: every lint id, in the order the docs list them
RULES: Final[Mapping[str, Rule]] = {
    rule.id: rule
    for rule in (
        Rule("W101", "unique_for is shorter than the task's time limit: the lock can "
             "expire mid-run", "set unique_for to at least the time limit"),
        Rule("W106", "the Redis store's maxmemory-policy can evict locks",
             'set maxmemory-policy to "noeviction" on the store\'s server'),
        Rule("I106", "cannot decide whether the Redis store's server evicts locks",
             "allow CONFIG GET, or check maxmemory-policy by hand and silence I106"),
        Rule("W107", 'a store that forgets its locks on restart holds unique_until="expiry" '
             "keys", "use a persistent store (Redis with RDB/AOF, SQL) for expiry keys"),
        Rule("I107", "cannot decide whether the store's server keeps locks across a restart",
             "allow CONFIG GET, or check persistence by hand and silence I107"),
        Rule("W108", "result_expires is shorter than unique_for while the reaper relies on "
             "results", "raise result_expires above unique_for (or set it to None)"),
        Rule("W109", "a memcached store with several servers",
             "use one memcached server (or a Redis/SQL store)"),
    )
}

#: the ids only the store's server can decide
SERVER_RULES: Final = frozenset({"W106", "I106", "W107", "I107"})

_REDIS: Final = frozenset({"redis", "rediss", "sentinel", "sentinels"})
_REDIS_CLUSTER: Final = frozenset({"redis+cluster", "rediss+cluster"})
_MEMCACHED: Final = frozenset({"memcached", "cache"})
#: Celery's default ``result_expires``: one day
_RESULT_EXPIRES: Final = 86400.0
#: the name of the reaper task (``celery_dedup.reaper.REAP_TASK_NAME``)
_REAPER: Final = "celery_dedup.reap"


@dataclass(frozen=True)
class Finding:
    """One lint finding: an id, what is wrong and the fix."""

    id: str
    message: str
    hint: str
    #: the task it is about (``None``: the whole app)
    task: str | None = None

    @property
    def is_info(self) -> bool:
        """Whether it says "cannot decide" rather than "this lets duplicates through"."""
        return self.id.startswith("I")

    def line(self) -> str:
        """``celery-dedup W101 (task t): … Fix: …`` on one line."""
        where = f" (task {self.task})" if self.task else ""
        return f"celery-dedup {self.id}{where}: {self.message}. Fix: {self.hint}."


@dataclass(frozen=True)
class AppFacts:
    """What the lint reads from an app's settings."""

    #: the lock store URL (``None``: no store)
    store_url: str | None
    #: seconds after which the broker delivers an unacknowledged message again (0: never)
    visibility_timeout: float
    #: seconds results are kept (``None``: forever)
    result_expires: float | None
    #: whether the app has the reaper task (``register_reaper``)
    reaper: bool
    #: ids silenced by ``dedup_silenced_warnings``
    silenced: frozenset[str] = frozenset()

    @property
    def store_scheme(self) -> str:
        """The store URL's scheme (``""`` without a store)."""
        return split_url(self.store_url)[0] if self.store_url else ""


@dataclass(frozen=True)
class TaskFacts:
    """What the lint reads from one ``DedupTask``."""

    name: str
    unique_for: float
    unique_until: UniqueUntil
    #: seconds of the hard and soft time limits (``None``: none)
    time_limit: float | None = None
    soft_time_limit: float | None = None
    acks_late: bool = False
    #: whether the task retries (``autoretry_for``, a ``max_retries`` it sets)
    retries: str | None = None
    ignore_result: bool = False
    #: ids silenced by the task's ``dedup_silenced``
    silenced: frozenset[str] = frozenset()

    @property
    def longest_limit(self) -> tuple[str, float] | None:
        """The longer time limit: ``(its name, seconds)``."""
        limits = [(n, v) for n, v in (("time_limit", self.time_limit),
                                      ("soft_time_limit", self.soft_time_limit)) if v]
        return max(limits, key=lambda item: item[1]) if limits else None


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def app_facts(app: Any) -> AppFacts:
    """Read ``AppFacts`` from a Celery app (no server is asked)."""
    from .runtime import broker_redelivers, visibility_timeout

    conf = app.conf
    try:
        url = derive_store_url(app)
    except Exception:  # an invalid dedup_store is reported by the option checks
        url = None
    expires = conf.get("result_expires", _RESULT_EXPIRES)
    return AppFacts(
        store_url=url,
        visibility_timeout=visibility_timeout(conf) if broker_redelivers(conf) else 0.0,
        result_expires=_seconds(expires) or None,
        reaper=_REAPER in app.tasks,
        silenced=validate_lint_ids(conf.get("dedup_silenced_warnings")),
    )


def _retries(task: Any) -> str | None:
    """How the task retries, in words, or ``None``."""
    if getattr(task, "autoretry_for", None):
        return "autoretry_for"
    from celery import Task

    for cls in type(task).__mro__:
        if cls is Task:
            break
        if "max_retries" in vars(cls):
            given = vars(cls)["max_retries"]
            if given is None or given > 0:
                return f"max_retries={given}"
            break
    return None


def task_facts(task: Any, *, retried: bool = False) -> TaskFacts:
    """Read ``TaskFacts`` from a ``DedupTask``; raises its option errors as is."""
    config = task.dedup_config()
    conf = task.app.conf
    acks_late = task.acks_late if task.acks_late is not None else conf.task_acks_late
    return TaskFacts(
        name=task.name,
        unique_for=config.unique_for,
        unique_until=config.unique_until,
        time_limit=_seconds(task.time_limit or conf.task_time_limit),
        soft_time_limit=_seconds(task.soft_time_limit or conf.task_soft_time_limit),
        acks_late=bool(acks_late),
        retries=_retries(task) or ("it called retry()" if retried else None),
        ignore_result=bool(task.ignore_result),
        silenced=validate_lint_ids(getattr(task, "dedup_silenced", None), "dedup_silenced"),
    )


def _g(seconds: float) -> str:
    return f"{seconds:g} s"


def _finding(rule: str, message: str, task: str | None = None) -> Finding:
    return Finding(rule, message, RULES[rule].fix, task)


def _task_rules(app: AppFacts, task: TaskFacts) -> Iterator[Finding]:
    limit = task.longest_limit
    holds_through_run = task.unique_until in (UniqueUntil.SUCCESS, UniqueUntil.FINISH)
    if limit is not None and holds_through_run and task.unique_for < limit[1]:
        yield _finding("W101", f"unique_for ({_g(task.unique_for)}) is shorter than "
                       f"{limit[0]} ({_g(limit[1])}): the lock can expire while the body "
                       "runs and a second call run beside it", task.name)
    # Retired, each shown by a real-worker scenario to run the body once:
    # W102 (a retry takes its key again when it is published, so the key is
    # held while the retry waits), W103, W104 and W105 (every copy the
    # broker delivers again, waiting for its ETA or while its run goes on,
    # is deferred by the running lease and refused by the done marker).
    expires = app.result_expires
    if (app.reaper and expires is not None and holds_through_run
            and not task.ignore_result and expires < task.unique_for):
        yield _finding("W108", f"result_expires ({_g(expires)}) is shorter than unique_for "
                       f"({_g(task.unique_for)}) and the reaper (celery_dedup.reap) frees "
                       "locks from stored results: a holder whose worker died keeps its key "
                       "blocked until the TTL once its result is gone", task.name)


def _silenced(finding: Finding, app: AppFacts, tasks: Mapping[str, TaskFacts]) -> bool:
    if finding.id in app.silenced:
        return True
    task = tasks.get(finding.task) if finding.task else None
    return task is not None and finding.id in task.silenced


def _unsilenced(found: Iterator[Finding], app: AppFacts,
                tasks: Sequence[TaskFacts]) -> list[Finding]:
    by_name = {task.name: task for task in tasks}
    return [f for f in found if not _silenced(f, app, by_name)]


def _forgets_on_restart(app: AppFacts) -> bool | None:
    """Whether the store forgets its locks on restart (``None``: the server must say)."""
    scheme = app.store_scheme
    if scheme == "memory" or scheme in _MEMCACHED:
        return True
    if scheme in _REDIS or scheme in _REDIS_CLUSTER or scheme == "django-cache":
        return None
    return False


def _expiry_tasks(app: AppFacts, tasks: Sequence[TaskFacts], rule: str) -> list[str]:
    return [t.name for t in tasks if t.unique_until is UniqueUntil.EXPIRY
            and rule not in t.silenced]


def lint_config(app: AppFacts, tasks: Sequence[TaskFacts]) -> list[Finding]:
    """The findings the settings alone decide (no server is asked)."""

    def found() -> Iterator[Finding]:
        for task in tasks:
            yield from _task_rules(app, task)
        expiry = _expiry_tasks(app, tasks, "W107")
        if expiry and _forgets_on_restart(app):
            yield _finding("W107", f"the {app.store_scheme} store keeps its locks in memory "
                           "only, so a restart of its server frees every idempotency key of "
                           f"{', '.join(expiry)} (unique_until=\"expiry\") and the same call "
                           "runs again")
        if app.store_scheme in _MEMCACHED and app.store_url:
            from .stores.memcached import parse_servers

            servers = parse_servers(app.store_url)[0]
            if len(servers) > 1:
                yield _finding("W109", f"the memcached store spreads keys over {len(servers)} "
                               "servers without failover: a server that restarts forgets its "
                               "share of the locks, and producers whose server lists differ "
                               "take the same key on different servers")

    return _unsilenced(found(), app, tasks)


def lint_server(
    app: AppFacts, tasks: Sequence[TaskFacts], server: Durability | None
) -> list[Finding]:
    """The findings only the store's server decides (``server``: its answer).

    ``server`` is ``None`` when the store cannot be asked at all (no
    ``DurabilityReport``): the rules then say they cannot decide.
    """

    def found() -> Iterator[Finding]:
        scheme = app.store_scheme
        redis = scheme in _REDIS or scheme in _REDIS_CLUSTER
        if not redis and scheme != "django-cache":
            return
        why = (server.error if server else None) or f"the {scheme} store cannot be asked"
        policy = server.eviction_policy if server else None
        # A Django cache on Redis answers (or fails) as Redis; other caches have no policy.
        if redis or (server is not None and (policy is not None or server.error)):
            yield from _eviction(policy, server, why)
        persistent = server.persistent if server else None
        if persistent is False:
            expiry = _expiry_tasks(app, tasks, "W107")
            if expiry:
                yield _finding("W107", f"the {scheme} store's server keeps its keys in memory "
                               "only (for Redis: no RDB snapshots and no AOF), so a restart "
                               f"frees every idempotency key of {', '.join(expiry)} "
                               "(unique_until=\"expiry\") and the same call runs again")
        elif persistent is None and _expiry_tasks(app, tasks, "I107"):
            yield _finding("I107", "cannot decide whether the store's server keeps the "
                           f"idempotency keys of unique_until=\"expiry\" tasks across a "
                           f"restart ({why})")

    return _unsilenced(found(), app, tasks)


def _eviction(policy: str | None, server: Durability | None, why: str) -> Iterator[Finding]:
    if policy is None:
        yield _finding("I106", "cannot decide whether the store's server evicts locks "
                       f"under memory pressure ({why})")
    elif policy != "noeviction":
        limit = (f"maxmemory {server.maxmemory} bytes" if server and server.maxmemory
                 else "no maxmemory yet (CONFIG SET can add one)")
        yield _finding("W106", f'the store\'s server has maxmemory-policy "{policy}" '
                       f"({limit}): under memory pressure it deletes keys with a TTL, "
                       "locks included, and a held key becomes free")


def lint_countdown(app: AppFacts, task: TaskFacts, countdown: float) -> Finding | None:
    """Always ``None``: ``W104`` (a countdown longer than the ``visibility_timeout``) is retired.

    Kept so that tools calling it keep working: the copies such a broker
    delivers again are refused by the run's records.
    """
    del app, task, countdown
    return None
