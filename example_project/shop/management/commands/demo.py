"""``manage.py demo``: celery-dedup in action against a real worker, then a summary table.

Migrates, clears what a previous run left (locks, task runs, queued
messages), starts ``celery worker`` as a subprocess, fires the duplicate
scenarios of ``shop.tasks``, waits for the worker, prints what was
published, suppressed, raised, run and released per task, stops the worker
and exits 0. Runs on whatever the settings configure: the zero-server
default (``filesystem://`` broker, SQLite results and locks) or Redis when
``REDIS_URL`` is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from celery_dedup import DuplicateTaskError, MissingDeduplicationKey, revoke
from celery_dedup.runtime import runtime_for

WORKER_START_TIMEOUT = 30.0
RESULT_TIMEOUT = 30.0


@dataclass
class Tally:
    """What happened to one task's calls."""

    published: list[Any] = field(default_factory=list)
    suppressed: int = 0
    raised: int = 0
    released_by_hand: int = 0


def _wait_released(result: Any, timeout: float = 5.0) -> None:
    """Wait for the worker's release of a finished task's lock, if its policy releases it.

    The worker stores the result first and releases the lock just after
    (``on_success``), so a caller that saw SUCCESS may be a moment early.
    """
    store = runtime_for(result.app).store
    if store is None or result.deduplication_key is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holder = store.get(result.deduplication_key)
        if holder is None or holder.owner != result.id or holder.policy == "expiry":
            return
        time.sleep(0.05)


class Command(BaseCommand):
    """Run the celery-dedup demo against a real worker."""

    help = "Start a worker, fire duplicate calls, print what celery-dedup did."

    def add_arguments(self, parser: Any) -> None:
        """``--keep-worker-log`` prints the worker's output at the end."""
        parser.add_argument("--show-worker-log", action="store_true",
                            help="Print the worker's log after the table.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Migrate, start the worker, run the scenarios, print the table."""
        from example_project.celery import app

        started = time.monotonic()
        call_command("migrate", interactive=False, verbosity=0)
        self._reset(app)
        log_path = Path(settings.VAR_DIR) / "demo-worker.log"
        worker = self._start_worker(log_path)
        try:
            self._wait_for_worker(app, worker, log_path)
            tallies = self._scenarios()
            rows = self._summarise(app, tallies)
        finally:
            self._stop_worker(worker)
        self._print_table(rows)
        self.stdout.write(
            f"\nbroker {app.conf.broker_url.split('://')[0]}://, results "
            f"{str(app.conf.result_backend).split('://')[0]}, lock store "
            f"{runtime_for(app).store!r}; {time.monotonic() - started:.1f}s"
        )
        if options["show_worker_log"]:
            self.stdout.write(log_path.read_text())

    # -- setup -----------------------------------------------------------------

    def _reset(self, app: Any) -> None:
        """Start from a clean slate: no locks, no task runs, no queued messages."""
        from shop.models import TaskRun

        runtime = runtime_for(app)
        store = runtime.store
        if store is not None:
            for lock in store.scan(runtime.settings.key_prefix + ":"):
                store.release(lock.key, lock.owner)
        TaskRun.objects.all().delete()
        options = app.conf.broker_transport_options or {}
        if str(app.conf.broker_url).startswith("filesystem://"):
            for name in ("data_folder_in", "control_folder"):
                folder = Path(options[name])
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True, exist_ok=True)
        else:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_purge(app.conf.task_default_queue)

    def _start_worker(self, log_path: Path) -> subprocess.Popen[bytes]:
        project_dir = Path(settings.BASE_DIR)
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get(
                "DJANGO_SETTINGS_MODULE", "example_project.settings"
            ),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(project_dir), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        argv = [
            sys.executable, "-m", "celery", "-A", "example_project", "worker",
            "--pool", "prefork", "--concurrency", "2", "--loglevel", "INFO",
            "--hostname", f"demo-{os.getpid()}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]
        self.stdout.write("starting a worker: " + " ".join(argv[1:]))
        with log_path.open("wb") as log:
            return subprocess.Popen(
                argv, cwd=project_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_for_worker(self, app: Any, worker: subprocess.Popen[bytes], log: Path) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise CommandError(f"the worker exited early:\n{log.read_text()[-3000:]}")
            if app.control.ping(timeout=0.5):
                return
        raise CommandError(f"the worker did not answer a ping:\n{log.read_text()[-3000:]}")

    def _stop_worker(self, worker: subprocess.Popen[bytes]) -> None:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGTERM)  # warm shutdown (the pool children follow)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)

    # -- the scenarios -----------------------------------------------------------

    def _scenarios(self) -> dict[str, Tally]:
        from shop import tasks

        names = {
            "send_digest": tasks.send_digest,
            "sync_address": tasks.sync_address,
            "process_payment": tasks.process_payment,
            "fulfill_order": tasks.fulfill_order,
            "probe_server": tasks.probe_server,
            "notify": tasks.notify,
            "purge_expired_locks": tasks.purge_expired_locks,
        }
        tallies = {name: Tally() for name in names}

        def call(name: str, *args: Any, **options: Any) -> Any:
            tally = tallies[name]
            try:
                result = names[name].apply_async(args, **options)
            except (DuplicateTaskError, MissingDeduplicationKey):
                tally.raised += 1
                return None
            if result.deduplicated:
                tally.suppressed += 1
            else:
                tally.published.append(result)
            return result

        home = {"street": "Invalidenstr. 1", "zip": "10115"}
        # A digest mailer: one digest per user per day, however often it is asked for.
        for user_id in (1, 1, 1, 2):
            call("send_digest", user_id)
        # Faktory's example: one sync queued until it succeeds; other args are other work.
        first_sync = call("sync_address", 42, home)
        call("sync_address", 42, home)
        call("sync_address", 42, {"street": "Unter den Linden 5", "zip": "10117"})
        # Payments: a double submit raises (the API answers 409).
        call("process_payment", "pay-1001", "19.99", "EUR")
        call("process_payment", "pay-1001", "19.99", "EUR")
        # Orders: keyed by the client's Idempotency-Key; none at all is refused.
        call("fulfill_order", 7, ["book"])
        call("fulfill_order", 7, ["book"], deduplication_key="order:key-7")
        call("fulfill_order", 7, ["book"], deduplication_key="order:key-7")
        # Health checks: one scheduled probe per server and attempt, with a deterministic id.
        countdown = tasks.probe_countdown(0)
        probe = call("probe_server", "https://peer.example", 0, countdown=countdown)
        call("probe_server", "https://peer.example", 0, countdown=countdown)
        # Notifications: never deduplicated.
        call("notify", 1, "welcome")
        call("notify", 1, "welcome")
        # The periodic cleanup, ticked by two beat instances at once.
        beat = {"headers": {"celery_beat_task": True}}
        call("purge_expired_locks", **beat)
        call("purge_expired_locks", **beat)

        # Once the first sync has succeeded its lock is gone: the same call publishes again.
        first_sync.get(timeout=RESULT_TIMEOUT, interval=0.1)
        _wait_released(first_sync)
        call("sync_address", 42, home)
        # The probe is not needed after all: revoke it, which releases its lock at once.
        if revoke(probe):
            tallies["probe_server"].released_by_hand += 1
        return tallies

    # -- the table ---------------------------------------------------------------

    def _summarise(self, app: Any, tallies: dict[str, Tally]) -> list[tuple[str, ...]]:
        from shop import tasks
        from shop.models import TaskRun

        for tally in tallies.values():
            for result in tally.published:
                if result.id == getattr(tallies["probe_server"].published[0], "id", None):
                    continue  # scheduled minutes ahead: revoked, never runs
                result.get(timeout=RESULT_TIMEOUT, interval=0.1)
        store = runtime_for(app).store
        for tally in tallies.values():
            for result in tally.published:
                if result.ready():
                    _wait_released(result)
        rows = []
        for name, tally in tallies.items():
            task_name = getattr(tasks, name).name
            runs = TaskRun.objects.filter(task_name=task_name).count()
            released = 0
            for result in tally.published:
                key = result.deduplication_key
                if key is None or store is None:
                    continue
                holder = store.get(key)
                if holder is None or holder.owner != result.id:
                    released += 1
            rows.append(
                (name, len(tally.published), tally.suppressed, tally.raised, runs, released)
            )
        return [tuple(str(cell) for cell in row) for row in rows]

    def _print_table(self, rows: list[tuple[str, ...]]) -> None:
        header = ("task", "published", "suppressed", "raised", "run", "released")
        totals = ("total", *(str(sum(int(r[i]) for r in rows)) for i in range(1, len(header))))
        table = [header, *rows, totals]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        self.stdout.write("")
        for i, row in enumerate(table):
            numbers = zip(row[1:], widths[1:], strict=True)
            cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in numbers)]
            self.stdout.write("  ".join(cells))
            if i == 0 or i == len(table) - 2:
                self.stdout.write("  ".join("-" * w for w in widths))
