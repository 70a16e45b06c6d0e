"""``celery dedup``: inspect and manage celery-dedup locks from the command line.

Registered under the ``celery.commands`` entry point, so it runs with the
app given to ``celery -A``::

    celery -A proj dedup list [--task NAME] [--json]
    celery -A proj dedup show KEY_OR_TASK_ID [--json]
    celery -A proj dedup release KEY [--force]
    celery -A proj dedup purge [--task NAME] [--expired] [--force]
    celery -A proj dedup stats [--json]
    celery -A proj dedup reap [--task NAME]

``KEY`` is a full store key or a unique prefix of its digest (the
``DIGEST`` column of ``list``). Every release is a compare-and-delete on
the holder ``list``/``show`` reported, so a lock taken by a new task in the
meantime is never deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import click
from celery import states
from celery.bin.base import CeleryCommand, CeleryOption
from celery.result import AsyncResult
from kombu.utils.json import dumps

from .api import release as release_lock
from .exceptions import ScanNotSupported, StoreUnavailable
from .metrics import EVENTS, live_locks
from .reaper import reap as reap_locks
from .runtime import Runtime, runtime_for
from .stores.base import Lock, LockStore
from .worker import short

__all__ = [
    "FINISHED_STATES",
    "dedup",
    "holder_state",
    "is_running",
    "list_lines",
    "lock_dict",
    "render_table",
]

#: result-backend states that mean "the holder is running"
RUNNING_STATES = frozenset({states.STARTED, states.RETRY})

#: result-backend states that mean "the holder has finished"
FINISHED_STATES = frozenset({*states.READY_STATES, states.IGNORED})

#: seconds ``release`` waits for workers to say whether they run the holder
INSPECT_TIMEOUT = 1.0


class _Context:
    """What every subcommand needs: the app's runtime and its store."""

    def __init__(self, ctx: click.Context) -> None:
        self.obj = ctx.obj
        self.app = ctx.obj.app
        # Under Django this runs django.setup() (DjangoFixup), which the
        # Django stores need before touching the ORM; as ``celery report`` does.
        self.app.loader.import_default_modules()
        self.runtime: Runtime = runtime_for(self.app)
        store = self.runtime.store
        if store is None:
            raise click.ClickException(
                "this app has no celery-dedup lock store (set dedup_store, or use a "
                "Redis/SQL result backend)"
            )
        self.store: LockStore = store
        self.prefix = self.runtime.settings.key_prefix

    def scan(self, task: str | None = None) -> list[Lock]:
        """Every live lock of the app (of ``task`` only, when given), by task then key."""
        prefix = f"{self.prefix}:{task}:" if task else f"{self.prefix}:"
        try:
            locks = [lock for lock in self.store.scan(prefix) if not task or lock.task_name == task]
        except (StoreUnavailable, ScanNotSupported) as exc:
            raise click.ClickException(str(exc)) from exc
        return sorted(locks, key=lambda lock: (lock.task_name, lock.key))

    def find(self, key_or_id: str, *, by_owner: bool = False) -> Lock:
        """The lock at a full key, a unique digest prefix or (``by_owner``) held by a task id."""
        try:
            if key_or_id.startswith(self.prefix + ":"):
                found = self.store.get(key_or_id)
                if found is None:
                    raise click.ClickException(f"no live lock at {key_or_id}")
                return found
        except StoreUnavailable as exc:
            raise click.ClickException(str(exc)) from exc
        locks = self.scan()
        matches = [lock for lock in locks if _digest(lock.key).startswith(key_or_id.lower())]
        if not matches and by_owner:
            matches = [lock for lock in locks if lock.task_id == key_or_id]
        if not matches:
            what = "key, digest or holder task id" if by_owner else "key or digest"
            raise click.ClickException(f"no live lock matches the {what} {key_or_id!r}")
        if len(matches) > 1:
            raise click.ClickException(
                f"{key_or_id!r} matches {len(matches)} locks; give more of the digest"
            )
        return matches[0]


def _digest(key: str) -> str:
    return key.rsplit(":", 1)[-1]


def lock_dict(lock: Lock, state: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "key": lock.key,
        "digest": _digest(lock.key),
        "task": lock.task_name,
        "holder": lock.task_id,
        "policy": lock.policy,
        "acquired_at": lock.acquired_at,
        "expires_at": lock.expires_at,
        "seconds_left": round(lock.ttl, 1),
    }
    if state is not None:
        data["holder_state"] = state
    return data


def render_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> Iterable[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        yield "  ".join(cells).rstrip()


def list_lines(locks: Sequence[Lock]) -> Iterable[str]:
    """The text of ``list``: a table of the locks and a count line."""
    if not locks:
        yield "No live locks."
        return
    rows = [
        (short(lock.key), lock.task_name, lock.task_id, lock.policy, f"{lock.ttl:.0f}")
        for lock in locks
    ]
    yield from render_table(rows, ("DIGEST", "TASK", "HOLDER", "POLICY", "SECONDS LEFT"))
    yield f"{len(locks)} live lock{'s' if len(locks) != 1 else ''}."


def holder_state(app: Any, task_id: str) -> str:
    """The holder's state as the result backend reports it (``UNKNOWN`` without one)."""
    try:
        return str(AsyncResult(task_id, app=app).state)
    except Exception:  # a disabled or unreachable result backend
        return "UNKNOWN"


def is_running(app: Any, task_id: str, state: str | None = None) -> tuple[bool, str]:
    """Whether the holder ``task_id`` is running now, and the state that says so.

    The rule: the result backend reports ``STARTED`` (needs
    ``task_track_started``) or ``RETRY``; or, unless the backend already
    reports it finished, a worker answers within ``INSPECT_TIMEOUT`` seconds
    that it is executing it (``inspect query_task``: ``active``).
    """
    state = state or holder_state(app, task_id)
    if state in RUNNING_STATES:
        return True, state
    if state in FINISHED_STATES:
        return False, state
    try:
        replies = app.control.inspect(timeout=INSPECT_TIMEOUT).query_task(task_id) or {}
    except Exception:  # no broker: cannot tell, the backend state stands
        return False, state
    for reply in replies.values():
        found = reply.get(task_id) if isinstance(reply, dict) else None
        if found and found[0] == "active":
            return True, "ACTIVE"
    return False, state


@click.group(name="dedup")
@click.pass_context
def dedup(ctx: click.Context) -> None:
    """Inspect and manage celery-dedup locks."""


@dedup.command(name="list", cls=CeleryCommand)
@click.option("--task", "task", cls=CeleryOption, help_group="Dedup Options",
              help="Only the locks of this task name.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Use json as output format.")
@click.pass_context
def list_(ctx: click.Context, /, task: str | None, as_json: bool, **kwargs: Any) -> None:
    """List the live locks: digest, task, holder id, policy, seconds left."""
    c = _Context(ctx)
    locks = c.scan(task)
    if as_json:
        c.obj.echo(dumps([lock_dict(lock) for lock in locks]))
        return
    for line in list_lines(locks):
        c.obj.echo(line)


@dedup.command(cls=CeleryCommand)
@click.argument("key_or_task_id")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Use json as output format.")
@click.pass_context
def show(ctx: click.Context, /, key_or_task_id: str, as_json: bool, **kwargs: Any) -> None:
    """Show one lock, by key, digest prefix or holder task id."""
    c = _Context(ctx)
    lock = c.find(key_or_task_id, by_owner=True)
    data = lock_dict(lock, holder_state(c.app, lock.task_id))
    if as_json:
        c.obj.echo(dumps(data))
        return
    for name, value in data.items():
        c.obj.echo(f"{name + ':':<14}{value}")


@dedup.command(cls=CeleryCommand)
@click.argument("key")
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Release even if the holder is running.")
@click.pass_context
def release(ctx: click.Context, /, key: str, force: bool, **kwargs: Any) -> None:
    """Release one lock (a running holder's lock needs --force)."""
    c = _Context(ctx)
    lock = c.find(key)
    running, state = is_running(c.app, lock.task_id)
    if running and not force:
        raise click.ClickException(
            f"lock {short(lock.key)} is held by {lock.task_name}[{lock.task_id}], which is "
            f"running ({state}); pass --force to release it anyway"
        )
    if release_lock(lock.key, owner=lock.owner, app=c.app):
        c.obj.echo(f"{c.obj.OK} released {short(lock.key)} held by "
                   f"{lock.task_name}[{lock.task_id}] ({state})")
    else:
        c.obj.echo(f"lock {short(lock.key)} was already gone or taken by another task")


@dedup.command(cls=CeleryCommand)
@click.option("--task", "task", cls=CeleryOption, help_group="Dedup Options",
              help="Only the locks of this task name.")
@click.option("--expired", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Only locks whose holder already finished (per the result backend).")
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Don't prompt for confirmation.")
@click.pass_context
def purge(
    ctx: click.Context, /, task: str | None, expired: bool, force: bool, **kwargs: Any
) -> None:
    """Release many locks: every lock, or one task's, or those of finished holders."""
    c = _Context(ctx)
    locks = c.scan(task)
    if expired:
        locks = [lock for lock in locks if holder_state(c.app, lock.task_id) in FINISHED_STATES]
    if not locks:
        c.obj.echo("No locks to purge.")
        return
    what = f"{len(locks)} lock{'s' if len(locks) != 1 else ''}"
    scope = f" of {task}" if task else ""
    if not force:
        click.confirm(
            f"{c.obj.style('WARNING', fg='red')}: this releases {what}{scope}; the same "
            "calls can then be published again.\n(to skip this prompt use the -f option)\n"
            "Are you sure?",
            abort=True,
        )
    released = sum(release_lock(lock.key, owner=lock.owner, app=c.app) for lock in locks)
    c.obj.echo(f"{c.obj.OK} released {released} of {what}{scope}.")


@dedup.command(cls=CeleryCommand)
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Dedup Options",
              help="Use json as output format.")
@click.pass_context
def stats(ctx: click.Context, /, as_json: bool, **kwargs: Any) -> None:
    """Per-task counters (acquired, deduplicated, released, fallback, skipped) and live locks."""
    c = _Context(ctx)
    try:
        counts = c.runtime.metrics.read()
    except TypeError as exc:
        raise click.ClickException(f"{exc}: no counters to show") from exc
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    live = live_locks(c.scan())
    tasks = sorted({name for name, _ in counts} | set(live))
    table = {
        name: {**{event: counts.get((name, event), 0) for event in EVENTS},
               "live_locks": live.get(name, 0)}
        for name in tasks
    }
    if as_json:
        c.obj.echo(dumps(table))
        return
    if not table:
        c.obj.echo("No counters yet.")
        return
    header = ("TASK", *(event.upper() for event in EVENTS), "LIVE LOCKS")
    rows = [(name, *(str(value) for value in row.values())) for name, row in table.items()]
    for line in render_table(rows, header):
        c.obj.echo(line)


@dedup.command(cls=CeleryCommand)
@click.option("--task", "task", cls=CeleryOption, help_group="Dedup Options",
              help="Only the locks of this task name.")
@click.pass_context
def reap(ctx: click.Context, /, task: str | None, **kwargs: Any) -> None:
    """Release locks whose holder finished in a state its policy releases on."""
    c = _Context(ctx)
    try:
        released = reap_locks(c.app, task_name=task)
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    for lock in released:
        c.obj.echo(f"{c.obj.OK} reaped {short(lock.key)} held by {lock.task_name}[{lock.task_id}]")
    c.obj.echo(f"{len(released)} lock{'s' if len(released) != 1 else ''} reaped.")
