"""``celery dedup``: inspect and manage celery-dedup locks from the command line.

Registered under the ``celery.commands`` entry point, so it runs with the
app given to ``celery -A``::

    celery -A proj dedup list [--task NAME] [--json]
    celery -A proj dedup show KEY_OR_TASK_ID [--json]
    celery -A proj dedup release KEY [--force] [--dry-run]
    celery -A proj dedup purge [--task NAME] [--force [--yes]] [--dry-run]
    celery -A proj dedup reap [--task NAME] [--dry-run]
    celery -A proj dedup stats [--json]
    celery -A proj dedup check [--json] [--timeout SECONDS]

``KEY`` is a full store key or a unique prefix of its digest (the
``DIGEST`` column of ``list``). No command frees a lock its policy still
needs unless told to with ``--force``: a lock is *needed* while its holder
has not finished (a release would let the same call be published and run
twice), and after it finished when ``unique_until`` keeps it (``expiry``
throttles and idempotency windows, ``success`` after a failure). Every
release is a compare-and-delete on the holder's owner token, so a lock
taken by a new task in the meantime is never deleted.

The same operations back ``manage.py dedup_locks`` (``Operator``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import click
from celery import states
from celery.bin.base import CeleryCommand, CeleryOption
from kombu.utils.json import dumps

from .api import release as release_lock
from .exceptions import ScanNotSupported, StoreError
from .metrics import EVENTS, OBSERVED, live_locks, per_key
from .reaper import reap as reap_locks
from .reaper import result_of_this_run, should_release
from .runtime import Runtime, runtime_for
from .startup import PROBE_TIMEOUT, lint_app, plain_tasks_with_options, probe_store, task_plans
from .stores.base import Lock, LockStore
from .worker import short

__all__ = [
    "FINISHED_STATES",
    "RUNNING_STATES",
    "Assessment",
    "CommandFailed",
    "Operator",
    "assess",
    "check_report",
    "dedup",
    "duration",
    "holder_state",
    "list_lines",
    "lock_dict",
    "render_table",
    "state_word",
    "when",
]

#: result-backend states that mean "the holder is running"
RUNNING_STATES = frozenset({states.STARTED, states.RETRY})

#: result-backend states that mean "the holder has finished"
FINISHED_STATES = frozenset({*states.READY_STATES, states.IGNORED})

_DRY = "(dry run) "

logger = logging.getLogger("celery_dedup")


class CommandFailed(Exception):
    """An operator error: printed as is, exit status 1."""


# -- formatting ---------------------------------------------------------------


def when(timestamp: float) -> str:
    """Epoch seconds as ``2026-11-22 14:05:03 UTC``."""
    moment = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    """Seconds as ``1d 3h``, ``2h 5m``, ``4m 10s``."""
    seconds = round(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    if hours or days:
        parts.append(f"{hours}h")
    if not days:
        parts.append(f"{minutes}m")
    if not days and not hours:
        parts.append(f"{secs}s")
    return " ".join(parts)


def _plural(n: int, word: str = "lock") -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def render_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> Iterable[str]:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        yield "  ".join(cells).rstrip()


def _of(value: Any) -> str:
    return "?" if value is None else str(value)


def live_limit_lines(found: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """``live_keys`` as the CLI prints it: a table per kind that has keys."""
    slots, windows = found["concurrency"], found["rate"]
    if not slots and not windows:
        return ["No slots in use and no publishes in any rate window."]
    lines: list[str] = []
    if slots:
        rows = [
            (row["digest"][:16], row["task"], f"{row['in_use']}/{_of(row['limit'])}")
            for row in slots
        ]
        lines += render_table(rows, ("DIGEST", "TASK", "SLOTS IN USE"))
        lines.append(f"{_plural(len(slots), 'concurrency key')} in use.")
    if windows:
        cells = [
            (
                row["digest"][:16],
                row["task"],
                f"{row['count']}/{_of(row['limit'])}",
                "?" if row["period"] is None else f"{row['period']:g}s",
                f"{row['free_in']:.1f}s" if row["free_in"] else "now",
            )
            for row in windows
        ]
        if lines:
            lines.append("")
        lines += render_table(cells, ("DIGEST", "TASK", "IN WINDOW", "PERIOD", "ROOM IN"))
        lines.append(f"{_plural(len(windows), 'rate key')} with publishes.")
    return lines


# -- what a lock's holder is doing, and whether the lock is still needed ------


def _holder_meta(app: Any, task_id: str) -> tuple[str, Any]:
    """``(state, date_done)`` of ``task_id`` from the result backend, in one read."""
    try:
        meta = app.backend.get_task_meta(task_id)
    except Exception:  # a disabled or unreachable result backend
        return "UNKNOWN", None
    return str(meta.get("status") or states.PENDING), meta.get("date_done")


def holder_state(app: Any, task_id: str) -> str:
    """The holder's state as the result backend reports it (``UNKNOWN`` without one)."""
    return _holder_meta(app, task_id)[0]


@dataclass(frozen=True)
class Assessment:
    """A lock, what its holder is doing, and whether its policy still needs the lock."""

    lock: Lock
    #: the result backend's state of the holder (``UNKNOWN`` without a backend)
    state: str
    #: ``"not started"``, ``"running"`` or ``"finished"``
    phase: str
    #: whether releasing it could let the same work run twice
    needed: bool
    #: one sentence saying why (shown when a release is refused)
    why: str

    @property
    def holder(self) -> str:
        """``task.name[task id]``."""
        return f"{self.lock.task_name}[{self.lock.task_id}]"


def assess(app: Any, lock: Lock) -> Assessment:
    """Whether ``lock`` is still needed, from its ``started`` flag and the result backend.

    - finished (a result stored after the lock was taken): needed unless
      ``unique_until`` releases on that state (``success``/``finish`` after
      SUCCESS, ``finish`` after FAILURE, all but ``expiry`` after REVOKED)
      and the lock is marked started (the release of a run that ended was
      lost): the reaper's rule;
    - running (the lock is marked started, or the backend says STARTED/RETRY):
      needed;
    - not started (queued, scheduled, or its message was lost): needed, since
      a queued message still runs after its lock was released.
    """
    state, done = _holder_meta(app, lock.task_id)
    left = duration(lock.ttl)
    finished = state in FINISHED_STATES and result_of_this_run(done, lock)
    releases = finished and should_release(lock, state)
    if releases and lock.started:
        why = (f"its holder ended {state} and unique_until={lock.policy!r} releases "
               "on that: nothing needs this lock")
        return Assessment(lock, state, "finished", False, why)
    if finished and not releases:
        why = (f"its holder ended {state}, and unique_until={lock.policy!r} keeps the lock "
               f"until it expires in {left} (a throttle or idempotency window): releasing it "
               "lets the same call run again")
        return Assessment(lock, state, "finished", True, why)
    if lock.started or state in RUNNING_STATES:
        why = (f"its holder is running ({state}): releasing it lets the same call be "
               "published and run while this one still runs")
        return Assessment(lock, state, "running", True, why)
    # Not started: any result under its id is another run's (the reaper's rule too).
    why = (f"its holder has not started ({state}: queued, scheduled, or its message was "
           "lost): releasing it lets the same call be published again, and both may run")
    return Assessment(lock, state, "not started", True, why)


# -- output ---------------------------------------------------------------------


def lock_dict(lock: Lock, found: Assessment | None = None) -> dict[str, Any]:
    """A lock as ``--json`` prints it (times as epoch seconds and ISO 8601 UTC)."""
    data: dict[str, Any] = {
        "key": lock.key,
        "digest": lock.key.rsplit(":", 1)[-1],
        "task": lock.task_name,
        "holder": lock.task_id,
        "policy": lock.policy,
        "started": lock.started,
        "acquired_at": lock.acquired_at,
        "acquired": datetime.fromtimestamp(lock.acquired_at, tz=timezone.utc).isoformat(),
        "expires_at": lock.expires_at,
        "expires": datetime.fromtimestamp(lock.expires_at, tz=timezone.utc).isoformat(),
        "seconds_left": round(lock.ttl, 1),
    }
    if found is not None:
        data.update(holder_state=found.state, phase=found.phase, needed=found.needed,
                    why=found.why)
    return data


def state_word(found: Assessment) -> str:
    """What ``list`` shows of a lock's holder: ``running``, ``queued``, ``finished:SUCCESS``…

    From the lock's start flag (set while a run holds it, cleared when the
    run ends) and the result backend; ``unknown`` when neither can tell
    (not running now, and no result backend to say whether it ran).
    """
    if found.phase == "finished":
        return f"finished:{found.state}"
    if found.phase == "running":
        return "running"
    return "unknown" if found.state == "UNKNOWN" else "queued"


def list_lines(found: Sequence[Assessment]) -> Iterable[str]:
    """The text of ``list``: a table of the locks and a count line."""
    if not found:
        yield "No live locks."
        return
    rows = [
        (short(f.lock.key), f.lock.task_name, f.lock.task_id, f.lock.policy, state_word(f),
         duration(f.lock.ttl))
        for f in found
    ]
    yield from render_table(rows, ("DIGEST", "TASK", "HOLDER", "POLICY", "STATE", "EXPIRES IN"))
    yield f"{_plural(len(found), 'live lock')}."


def _show_lines(found: Assessment) -> Iterable[str]:
    lock = found.lock
    fields = [
        ("key", lock.key),
        ("task", lock.task_name),
        ("holder", lock.task_id),
        ("holder state", f"{found.state} ({found.phase})"),
        ("policy", lock.policy),
        ("acquired", when(lock.acquired_at)),
        ("expires", f"{when(lock.expires_at)} (in {duration(lock.ttl)})"),
        ("needed", f"{'yes' if found.needed else 'no'}: {found.why}"),
    ]
    for name, value in fields:
        yield f"{name + ':':<14}{value}"


# -- the operations (shared by ``celery dedup`` and ``manage.py dedup_locks``) ----


class Operator:
    """The lock operations of one app, printing through ``echo``.

    ``confirm(question)`` asks the operator and returns the answer. Errors
    raise ``CommandFailed`` with the message to print.
    """

    def __init__(
        self,
        app: Any,
        echo: Callable[[str], None],
        confirm: Callable[[str], bool],
        *,
        ok: str = "OK",
    ) -> None:
        self.app = app
        self.echo = echo
        self.confirm = confirm
        self.ok = ok
        # Finalizing binds every task: the celery-once / celery-singleton shims
        # adopt their library's lock URL (ONCE, singleton_backend_url) as
        # dedup_store then, so the operator sees the store the shim locks in.
        app.finalize()
        self.runtime: Runtime = runtime_for(app)
        store = self.runtime.store
        if store is None:
            raise CommandFailed(
                "this app has no celery-dedup lock store (set dedup_store, or use a "
                "Redis, SQL or django-db result backend)"
            )
        self.store: LockStore = store
        self.prefix = self.runtime.settings.key_prefix

    # -- finding locks -----------------------------------------------------

    def scan(self, task: str | None = None) -> list[Lock]:
        """Every live lock of the app (of ``task`` only, when given), by task then key."""
        prefix = f"{self.prefix}:{task}:" if task else f"{self.prefix}:"
        try:
            locks = [lock for lock in self.store.scan(prefix) if not task or lock.task_name == task]
        except (StoreError, ScanNotSupported) as exc:
            raise CommandFailed(str(exc)) from exc
        return sorted(locks, key=lambda lock: (lock.task_name, lock.key))

    def find(self, key_or_id: str, *, by_holder: bool = False) -> Lock:
        """The lock at a full key or a unique digest prefix; or (``by_holder``) its holder's id.

        A holder task id may be given in full or as a unique prefix.
        """
        if key_or_id.startswith(self.prefix + ":"):
            try:
                found = self.store.get(key_or_id)
            except StoreError as exc:
                raise CommandFailed(str(exc)) from exc
            if found is None:
                raise CommandFailed(f"no live lock at {key_or_id}")
            return found
        locks = self.scan()
        wanted = key_or_id.lower()
        matches = [lock for lock in locks if lock.key.rsplit(":", 1)[-1].startswith(wanted)]
        if not matches and by_holder:
            matches = [lock for lock in locks if lock.task_id.lower().startswith(wanted)]
        if not matches:
            what = "key, digest or holder task id" if by_holder else "key or digest"
            raise CommandFailed(f"no live lock matches the {what} {key_or_id!r}")
        if len(matches) > 1:
            raise CommandFailed(
                f"{key_or_id!r} matches {len(matches)} locks; give more of it"
            )
        return matches[0]

    def _memory_note(self) -> None:
        if self.store.name == "memory":
            self.echo("(memory:// store: only the locks of this very process are listed)")

    # -- commands ----------------------------------------------------------

    def list(self, task: str | None = None, as_json: bool = False) -> None:
        """Print the live locks as a table (or JSON)."""
        # One result-backend read per lock: the start flag alone cannot tell a
        # holder that ran (its flag cleared at the end) from one still queued.
        found = [assess(self.app, lock) for lock in self.scan(task)]
        if as_json:
            self.echo(dumps([lock_dict(f.lock, f) for f in found]))
            return
        for line in list_lines(found):
            self.echo(line)
        self._memory_note()

    def show(self, key_or_task_id: str, as_json: bool = False) -> None:
        """Print one lock, its holder's state and whether it is still needed."""
        found = assess(self.app, self.find(key_or_task_id, by_holder=True))
        if as_json:
            self.echo(dumps(lock_dict(found.lock, found)))
            return
        for line in _show_lines(found):
            self.echo(line)

    def release(self, key: str, *, force: bool = False, dry_run: bool = False) -> None:
        """Release one lock; a lock its policy still needs only with ``force``."""
        found = assess(self.app, self.find(key))
        digest = short(found.lock.key)
        if found.needed and not force:
            raise CommandFailed(
                f"lock {digest} of {found.holder} is still needed: {found.why}. "
                "Pass --force to release it anyway."
            )
        if dry_run:
            self.echo(f"{_DRY}would release {digest} held by {found.holder} ({found.phase})")
            return
        if self._release(found, forced=found.needed):
            self.echo(f"{self.ok} released {digest} held by {found.holder} ({found.phase})")
        else:
            raise CommandFailed(f"lock {digest} was already gone or taken by another task")

    def purge(
        self,
        task: str | None = None,
        *,
        force: bool = False,
        yes: bool = False,
        dry_run: bool = False,
    ) -> None:
        """Release the locks nobody needs any more; with ``force`` every selected lock."""
        found = [assess(self.app, lock) for lock in self.scan(task)]
        scope = f" of {task}" if task else ""
        if not found:
            self.echo(f"No locks{scope} to purge.")
            return
        needed = [f for f in found if f.needed]
        chosen = found if force else [f for f in found if not f.needed]
        if needed and not force:
            self.echo(f"Keeping {_plural(len(needed))}{scope} still needed "
                      "(--force releases them too):")
            for item in needed:
                self.echo(f"  {short(item.lock.key)}  {item.holder}: {item.why}")
        if not chosen:
            self.echo(f"No locks{scope} to purge.")
            return
        if dry_run:
            for item in chosen:
                self.echo(f"{_DRY}would release {short(item.lock.key)} held by {item.holder} "
                          f"({item.phase}{', needed' if item.needed else ''})")
            self.echo(f"{_DRY}{_plural(len(chosen))}{scope} would be released.")
            return
        if force and needed and not yes and not self.confirm(
            f"This releases {_plural(len(needed))}{scope} still needed: the same calls can "
            "then be published and run again. Are you sure?"
        ):
            raise CommandFailed("purge cancelled; nothing was released")
        released = sum(self._release(item, forced=item.needed) for item in chosen)
        self.echo(f"{self.ok} released {released} of {_plural(len(chosen))}{scope}.")

    def reap(self, task: str | None = None, *, dry_run: bool = False) -> None:
        """Release the locks of holders that finished in a state their policy releases on."""
        if dry_run:
            stale = [f for f in (assess(self.app, lock) for lock in self.scan(task))
                     if not f.needed]
            for item in stale:
                self.echo(f"{_DRY}would reap {short(item.lock.key)} held by {item.holder} "
                          f"({item.state})")
            self.echo(f"{_DRY}{_plural(len(stale))} would be reaped.")
            return
        try:
            reaped = reap_locks(self.app, task_name=task)
        except (StoreError, ScanNotSupported) as exc:
            raise CommandFailed(f"cannot reap: {exc}") from exc
        for lock in reaped:
            holder = f"{lock.task_name}[{lock.task_id}]"
            self.echo(f"{self.ok} reaped {short(lock.key)} held by {holder}")
        self.echo(f"{_plural(len(reaped))} reaped.")

    def stats(self, as_json: bool = False, top: int = 0) -> None:
        """Per-task counters every process flushed to the store, and live locks.

        ``top``: also the ``top`` keys with the most observed calls
        (``dedup_mode="observe"``: the ``would_*`` counters kept per key).
        """
        try:
            counts = self.runtime.metrics.read()
        except TypeError as exc:
            raise CommandFailed(f"{exc}: no counters to show") from exc
        except StoreError as exc:
            raise CommandFailed(str(exc)) from exc
        counts, keys = per_key(counts)
        live = live_locks(self.scan())
        tasks = sorted({name for name, _ in counts} | set(live))
        table = {
            name: {**{event: counts.get((name, event), 0) for event in EVENTS},
                   "live_locks": live.get(name, 0)}
            for name in tasks
        }
        hot = top_keys(keys, top) if top > 0 else None
        if as_json:
            self.echo(dumps(table if hot is None else {"tasks": table, "top_keys": hot}))
            return
        if not table:
            self.echo("No counters yet.")
            return
        header = ("TASK", *(event.upper() for event in EVENTS), "LIVE_LOCKS")
        rows = [(name, *(str(value) for value in row.values())) for name, row in table.items()]
        for line in render_table(rows, header):
            self.echo(line)
        if hot is not None:
            self.echo("")
            if not hot:
                self.echo("No observed calls yet (dedup_mode='observe').")
            else:
                self.echo(f"Top {len(hot)} keys by observed calls (dedup_mode='observe'):")
                header = ("TASK", "KEY", *(event.upper() for event in OBSERVED), "TOTAL")
                rows = [
                    (item["task"], item["key"], *(str(item[event]) for event in OBSERVED),
                     str(item["total"]))
                    for item in hot
                ]  # fmt: skip
                for line in render_table(rows, header):
                    self.echo(line)
        self._memory_note()

    # -- helpers -----------------------------------------------------------

    def _release(self, found: Assessment, *, forced: bool) -> bool:
        """Owner-checked release of the holder that was assessed."""
        lock = found.lock
        released = release_lock(lock.key, owner=lock.owner, app=self.app)
        if released and forced:
            logger.warning(
                "celery-dedup: lock %s of %s released by hand although still needed (%s)",
                short(lock.key), found.holder, found.phase,
            )
        return released


def top_keys(keys: Mapping[tuple[str, str], Mapping[str, int]], n: int) -> list[dict[str, Any]]:
    """The ``n`` keys with the most observed calls, most first (then by task and key)."""
    ranked = sorted(
        ((sum(counts.get(event, 0) for event in OBSERVED), task, digest, counts)
         for (task, digest), counts in keys.items()),
        key=lambda item: (-item[0], item[1], item[2]),
    )  # fmt: skip
    return [
        {"task": task, "key": digest, **{event: counts.get(event, 0) for event in OBSERVED},
         "total": total}
        for total, task, digest, counts in ranked
        if total > 0
    ][:n]  # fmt: skip


# -- check: is deduplication working? -------------------------------------------


def check_report(app: Any, timeout: float = PROBE_TIMEOUT) -> tuple[bool, dict[str, Any]]:
    """Probe the store, resolve every ``DedupTask``; ``(all usable, report)``.

    Not usable: the store failed its acquire/release round trip (or none
    can be derived), a task's options are invalid, a task that is not a
    ``DedupTask`` sets dedup options nothing reads, or the settings lint
    (``celery_dedup.lint``) found a warning that is not silenced (its
    "cannot decide" infos are reported without failing).
    """
    app.finalize()  # binds the tasks: the shims adopt their lock URL
    probe = probe_store(app, timeout)
    plans = task_plans(app)
    plain = plain_tasks_with_options(app)
    found = lint_app(app, ask_server=probe.ok, timeout=timeout)
    report = {
        "store": {"url": probe.url, "name": probe.store, "ok": probe.ok, "error": probe.error,
                  "round_trip_ms": round(probe.elapsed * 1000, 1)},
        "fallback": app.conf.get("dedup_fallback") or "open",
        "tasks": [vars(plan) for plan in plans],
        "not_deduplicated": {name: list(options) for name, options in plain.items()},
        "lint": [vars(finding) for finding in found],
    }
    warned = any(not finding.is_info for finding in found)
    ok = probe.ok and not any(plan.error for plan in plans) and not plain and not warned
    return ok, report


def check_lines(ok: bool, report: dict[str, Any], ok_mark: str = "OK") -> Iterable[str]:
    """``check_report``'s report in words and a table."""
    store = report["store"]
    where = f"{store['name'] or 'lock'} store at {store['url']}" if store["url"] else "no store"
    if store["ok"]:
        yield f"{ok_mark} {where}: acquire/release round trip in {store['round_trip_ms']} ms"
    else:
        yield f"ERROR {where}: {store['error']}"
    yield f"dedup_fallback: {report['fallback']}"
    tasks = report["tasks"]
    if tasks:
        yield ""
        rows = [(t["name"], t["unique_until"], duration(t["unique_for"]) if not t["error"]
                 else "?", t["identity"], t["on_duplicate"], t.get("limits") or "",
                 t["error"] or "")
                for t in tasks]
        header = ("TASK", "UNIQUE_UNTIL", "TTL", "IDENTITY", "ON_DUPLICATE", "LIMITS", "ERROR")
        yield from render_table(rows, header)
    else:
        yield "No DedupTask is registered on this app."
    for name, options in report["not_deduplicated"].items():
        yield (f"WARNING {name} sets {', '.join(options)} but is not a DedupTask: "
               "nothing deduplicates it")
    for finding in report["lint"]:
        level = "INFO" if finding["id"].startswith("I") else "WARNING"
        task = f" {finding['task']}" if finding["task"] else ""
        yield f"{level} {finding['id']}{task}: {finding['message']}"
        yield f"    fix: {finding['hint']} (silence: dedup_silenced_warnings=[{finding['id']!r}])"
    yield ""
    yield (f"{ok_mark} deduplication is working" if ok
           else "ERROR deduplication is NOT working as configured (see above)")


# -- the click commands -----------------------------------------------------------

_GROUP = "Dedup Options"


def _operator(ctx: click.Context) -> Operator:
    obj = ctx.obj
    # Under Django this runs django.setup() (DjangoFixup), which the Django
    # stores need before touching the ORM; as ``celery report`` does.
    obj.app.loader.import_default_modules()
    try:
        return Operator(obj.app, obj.echo, lambda q: click.confirm(q, default=False),
                        ok=obj.OK)
    except CommandFailed as exc:
        raise click.ClickException(str(exc)) from exc


def _run(ctx: click.Context, action: Callable[[Operator], None]) -> None:
    try:
        action(_operator(ctx))
    except CommandFailed as exc:
        raise click.ClickException(str(exc)) from exc


_task_option = click.option("--task", "task", cls=CeleryOption, help_group=_GROUP,
                            metavar="NAME", help="Only the locks of this task name.")
_json_option = click.option("--json", "as_json", cls=CeleryOption, is_flag=True,
                            help_group=_GROUP, help="Print JSON.")
_dry_run_option = click.option("--dry-run", "dry_run", cls=CeleryOption, is_flag=True,
                               help_group=_GROUP, help="Only print what would be released.")


@click.group(name="dedup")
@click.pass_context
def dedup(ctx: click.Context) -> None:
    """Inspect and manage celery-dedup locks.

    KEY is a full lock key or a unique prefix of its digest (the DIGEST
    column of `list`). No command releases a lock its policy still needs
    (holder not finished, or an `expiry`/idempotency window) without --force.
    """


@dedup.command(name="list", cls=CeleryCommand)
@_task_option
@_json_option
@click.pass_context
def list_(ctx: click.Context, /, task: str | None, as_json: bool, **kwargs: Any) -> None:
    """List the live locks.

    Columns: key digest, task, holder task id, unique_until policy, the
    holder's state (queued, running, finished:STATE; unknown without a
    result backend), time left.
    """
    _run(ctx, lambda op: op.list(task, as_json))


@dedup.command(cls=CeleryCommand)
@click.argument("key_or_task_id", metavar="KEY_OR_TASK_ID")
@_json_option
@click.pass_context
def show(ctx: click.Context, /, key_or_task_id: str, as_json: bool, **kwargs: Any) -> None:
    """Show one lock and whether it is needed.

    KEY_OR_TASK_ID is a key, a digest prefix, or the holder's task id (or a
    unique prefix of it).
    """
    _run(ctx, lambda op: op.show(key_or_task_id, as_json))


@dedup.command(cls=CeleryCommand)
@click.argument("key", metavar="KEY")
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help_group=_GROUP,
              help="Release even a lock its policy still needs.")
@_dry_run_option
@click.pass_context
def release(ctx: click.Context, /, key: str, force: bool, dry_run: bool, **kwargs: Any) -> None:
    """Release one lock (owner-checked).

    A lock still needed (holder not finished, or kept by unique_until after
    it finished) is refused with the reason, unless --force.
    """
    _run(ctx, lambda op: op.release(key, force=force, dry_run=dry_run))


@dedup.command(cls=CeleryCommand)
@_task_option
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help_group=_GROUP,
              help="Also release locks still needed (asks first).")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group=_GROUP,
              help="Don't ask before --force releases needed locks.")
@click.option("--expired", cls=CeleryOption, is_flag=True, hidden=True,
              help="Deprecated: purge releases only unneeded locks by default.")
@_dry_run_option
@click.pass_context
def purge(
    ctx: click.Context, /, task: str | None, force: bool, yes: bool, expired: bool,
    dry_run: bool, **kwargs: Any,
) -> None:
    """Release the locks no longer needed.

    Releases the locks whose holder finished in a state its unique_until
    releases on, and lists the others with the reason they are kept.
    --force releases those too, after asking (--yes skips the question).
    """
    if expired:
        click.echo("--expired is deprecated and has no effect: purge now releases only the "
                   "locks no longer needed, unless --force.", err=True)
    _run(ctx, lambda op: op.purge(task, force=force, yes=yes, dry_run=dry_run))


@dedup.command(cls=CeleryCommand)
@_task_option
@_dry_run_option
@click.pass_context
def reap(ctx: click.Context, /, task: str | None, dry_run: bool, **kwargs: Any) -> None:
    """Release locks of finished holders (as purge).

    Releases, owner-checked, the locks whose holder's stored result says it
    ended in a state its unique_until releases on.
    """
    _run(ctx, lambda op: op.reap(task, dry_run=dry_run))


@dedup.command(cls=CeleryCommand)
@_json_option
@click.pass_context
@click.option("--top", cls=CeleryOption, type=click.IntRange(min=0), default=0,
              help_group=_GROUP,
              help="Also list the N keys with the most observed calls (dedup_mode='observe').")
def stats(ctx: click.Context, /, as_json: bool, top: int, **kwargs: Any) -> None:
    """Per-task counters and live locks.

    Counters: acquired, deduplicated, released (by workers), released_manual
    (release/revoke/purge/reap), fallback, skipped, deferred, rate_limited,
    and under dedup_mode='observe' would_deduplicate, would_replace,
    would_cancel, would_rate_limit (calls published anyway). --top N lists
    the keys (digests) with the most observed calls.
    """
    _run(ctx, lambda op: op.stats(as_json, top))


@dedup.command(cls=CeleryCommand)
@_json_option
@click.option("--timeout", cls=CeleryOption, type=float, default=PROBE_TIMEOUT,
              show_default=True, help_group=_GROUP,
              help="Seconds to wait for the store before calling it unreachable.")
@click.pass_context
def check(ctx: click.Context, /, as_json: bool, timeout: float, **kwargs: Any) -> None:
    """Probe the store; show each task's options; lint the settings.

    Takes and releases one lock on the store, then prints what each
    registered DedupTask would use (policy, TTL, identity, on_duplicate)
    and the settings lint's findings (W1xx: a hole that lets duplicates or
    lost work through; I1xx: undecidable without the server's answer).
    Exits 1 when the store is unusable, a task's options are invalid, a
    task that is not a DedupTask sets dedup options, or a W1xx is reported.
    """
    app = ctx.obj.app
    app.loader.import_default_modules()
    ok, report = check_report(app, timeout)
    if as_json:
        ctx.obj.echo(dumps({"ok": ok, **report}))
    else:
        for line in check_lines(ok, report, ctx.obj.OK):
            ctx.obj.echo(line)
    if not ok:
        ctx.exit(1)


@dedup.command(cls=CeleryCommand)
@click.argument("task_name", metavar="[TASK", required=False)
@click.argument("key", metavar="[KEY]]", required=False)
@_json_option
@click.pass_context
def limits(
    ctx: click.Context, /, task_name: str | None, key: str | None, as_json: bool, **kwargs: Any
) -> None:
    """List the per-key slots and rate windows in use.

    For tasks with per-key limits (concurrency_limit, rate_limit_per_key).
    Without KEY: every concurrency key with slots in use and every rate
    key with publishes in its window (of TASK only, when given), by the
    digest of the key (the key's text is never stored). KEY is what the
    task's concurrency_key / rate_key yields for a call (e.g. the user
    "42" for "{user}"), or the full lock key when the limit is keyed on the
    deduplication key.
    """
    from . import limits as per_key
    from .exceptions import DedupError
    from .task import DedupTask

    app = ctx.obj.app
    app.loader.import_default_modules()
    app.finalize()
    try:
        if key is None:
            runtime = runtime_for(app)
            if task_name is not None and not isinstance(app.tasks.get(task_name), DedupTask):
                raise click.ClickException(f"no DedupTask named {task_name!r}")
            listed = per_key.live_keys(
                runtime.store, runtime.settings.key_prefix, app.tasks, task_name
            )
            if as_json:
                ctx.obj.echo(dumps(listed))
                return
            for line in live_limit_lines(listed):
                ctx.obj.echo(line)
            return
        task = app.tasks.get(task_name)
        if not isinstance(task, DedupTask):
            raise click.ClickException(f"no DedupTask named {task_name!r}")
        found = per_key.usage(task, key)
    except DedupError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        ctx.obj.echo(dumps(found))
        return
    for line in per_key.usage_lines(found):
        ctx.obj.echo(line)
