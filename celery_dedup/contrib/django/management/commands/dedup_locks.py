"""``manage.py dedup_locks``: the ``celery dedup`` CLI as a Django management command.

::

    manage.py dedup_locks list [--task NAME] [--json]
    manage.py dedup_locks show KEY_OR_DIGEST_OR_TASK_ID [--json]
    manage.py dedup_locks release KEY_OR_DIGEST [--force]
    manage.py dedup_locks purge [--task NAME] [--expired] [--force]

Same subcommands, options and rules as ``celery -A proj dedup`` (it reuses
its helpers), on the store of the project's Celery app (``current_app``).
Every release is owner-checked; ``release`` refuses a holder that is running
unless ``--force``; ``purge --expired`` only releases locks whose holder has
finished, per the result backend; ``purge`` asks first unless ``--force``
(or ``--noinput``).
"""

from __future__ import annotations

from json import dumps
from typing import Any, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_dedup.api import release
from celery_dedup.cli import FINISHED_STATES, holder_state, is_running, list_lines, lock_dict
from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import Lock, LockStore
from celery_dedup.worker import short


def _digest(key: str) -> str:
    return key.rsplit(":", 1)[-1]


class Command(BaseCommand):  # type: ignore[misc]
    """Inspect and manage celery-dedup locks."""

    help = "List, show, release or purge the celery-dedup locks of the project's Celery app."

    def add_arguments(self, parser: CommandParser) -> None:
        """Subcommands ``list``, ``show``, ``release``, ``purge``."""
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = sub.add_parser("list", help="List the live locks.")
        listing.add_argument("--task", help="Only the locks of this task name.")
        listing.add_argument("--json", action="store_true", dest="as_json",
                             help="Use json as output format.")
        show = sub.add_parser("show", help="Show one lock, by key, digest prefix or holder id.")
        show.add_argument("key_or_task_id")
        show.add_argument("--json", action="store_true", dest="as_json",
                          help="Use json as output format.")
        rel = sub.add_parser("release", help="Release one lock (owner-checked).")
        rel.add_argument("key")
        rel.add_argument("-f", "--force", action="store_true",
                         help="Release even if the holder is running.")
        purge = sub.add_parser("purge", help="Release many locks.")
        purge.add_argument("--task", help="Only the locks of this task name.")
        purge.add_argument("--expired", action="store_true",
                           help="Only locks whose holder already finished.")
        purge.add_argument("-f", "--force", "--noinput", "--no-input", action="store_true",
                           dest="force", help="Don't prompt for confirmation.")

    # -- helpers -------------------------------------------------------------

    def _setup(self) -> tuple[Any, LockStore, str]:
        from celery import current_app

        app = cast(Any, current_app)._get_current_object()
        runtime = runtime_for(app)
        store = runtime.store
        if store is None:
            raise CommandError(
                "this app has no celery-dedup lock store (set CELERY_DEDUP_STORE, or use a "
                "django-db, Redis or SQL result backend)"
            )
        return app, store, runtime.settings.key_prefix

    def _scan(self, store: LockStore, prefix: str, task: str | None) -> list[Lock]:
        scan_prefix = f"{prefix}:{task}:" if task else f"{prefix}:"
        try:
            locks = [lock for lock in store.scan(scan_prefix)
                     if not task or lock.task_name == task]
        except StoreUnavailable as exc:
            raise CommandError(str(exc)) from exc
        return sorted(locks, key=lambda lock: (lock.task_name, lock.key))

    def _find(self, store: LockStore, prefix: str, key_or_id: str, by_owner: bool) -> Lock:
        if key_or_id.startswith(prefix + ":"):
            found = store.get(key_or_id)
            if found is None:
                raise CommandError(f"no live lock at {key_or_id}")
            return found
        locks = self._scan(store, prefix, None)
        matches = [lock for lock in locks if _digest(lock.key).startswith(key_or_id.lower())]
        if not matches and by_owner:
            matches = [lock for lock in locks if lock.task_id == key_or_id]
        if not matches:
            what = "key, digest or holder task id" if by_owner else "key or digest"
            raise CommandError(f"no live lock matches the {what} {key_or_id!r}")
        if len(matches) > 1:
            raise CommandError(
                f"{key_or_id!r} matches {len(matches)} locks; give more of the digest"
            )
        return matches[0]

    # -- subcommands ---------------------------------------------------------

    def handle(self, *args: Any, **options: Any) -> None:
        """Dispatch to the subcommand."""
        getattr(self, f"do_{options['action']}")(**options)

    def do_list(self, task: str | None = None, as_json: bool = False, **_: Any) -> None:
        """The live locks: digest, task, holder id, policy, seconds left."""
        _app, store, prefix = self._setup()
        locks = self._scan(store, prefix, task)
        if as_json:
            self.stdout.write(dumps([lock_dict(lock) for lock in locks]))
            return
        for line in list_lines(locks):
            self.stdout.write(line)

    def do_show(self, key_or_task_id: str, as_json: bool = False, **_: Any) -> None:
        """One lock and its holder's state."""
        app, store, prefix = self._setup()
        lock = self._find(store, prefix, key_or_task_id, by_owner=True)
        data = lock_dict(lock, holder_state(app, lock.task_id))
        if as_json:
            self.stdout.write(dumps(data))
            return
        for name, value in data.items():
            self.stdout.write(f"{name + ':':<14}{value}")

    def do_release(self, key: str, force: bool = False, **_: Any) -> None:
        """Release one lock, owner-checked; a running holder's needs ``--force``."""
        app, store, prefix = self._setup()
        lock = self._find(store, prefix, key, by_owner=False)
        running, state = is_running(app, lock.task_id)
        if running and not force:
            raise CommandError(
                f"lock {short(lock.key)} is held by {lock.task_name}[{lock.task_id}], which is "
                f"running ({state}); pass --force to release it anyway"
            )
        if release(lock.key, owner=lock.owner, app=app):
            self.stdout.write(self.style.SUCCESS(
                f"released {short(lock.key)} held by {lock.task_name}[{lock.task_id}] ({state})"
            ))
        else:
            self.stdout.write(
                f"lock {short(lock.key)} was already gone or taken by another task"
            )

    def do_purge(
        self, task: str | None = None, expired: bool = False, force: bool = False, **_: Any
    ) -> None:
        """Release every lock, or one task's, or those of finished holders."""
        app, store, prefix = self._setup()
        locks = self._scan(store, prefix, task)
        if expired:
            locks = [lock for lock in locks if holder_state(app, lock.task_id) in FINISHED_STATES]
        if not locks:
            self.stdout.write("No locks to purge.")
            return
        what = f"{len(locks)} lock{'s' if len(locks) != 1 else ''}"
        scope = f" of {task}" if task else ""
        if not force:
            answer = input(
                f"This releases {what}{scope}; the same calls can then be published again.\n"
                "Type 'yes' to continue, or 'no' to cancel: "
            )
            if answer.strip().lower() != "yes":
                raise CommandError("purge cancelled")
        released = sum(release(lock.key, owner=lock.owner, app=app) for lock in locks)
        self.stdout.write(self.style.SUCCESS(f"released {released} of {what}{scope}."))
