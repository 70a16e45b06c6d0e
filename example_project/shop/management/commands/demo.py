"""``manage.py demo``: celery-dedup in action against a real worker, then a summary table.

Migrates, refuses to go on if a worker already runs on the broker (it never
touches a worker it did not start), clears what a previous run left (locks,
task runs, queued messages), starts ``celery worker`` as a subprocess, fires
the duplicate scenarios of ``shop.tasks`` and tells for each what was called
and what celery-dedup did and why, waits for the worker, prints a table of
what was published, suppressed, refused, run and released per task (its
columns explained below it), stops the worker and exits 0. Runs on whatever
the settings configure: the zero-server default (``filesystem://`` broker,
SQLite results and locks) or Redis when ``REDIS_URL`` is set.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from kombu.utils.url import maybe_sanitize_url

from celery_dedup import DuplicateTaskError, MissingDeduplicationKey, revoke
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import derive_store_url

WORKER_START_TIMEOUT = 30.0
RESULT_TIMEOUT = 30.0
#: the address ``sync_address`` syncs twice
HOME = {"street": "Invalidenstr. 1", "zip": "10115"}


@dataclass
class Tally:
    """What happened to one task's calls."""

    published: list[Any] = field(default_factory=list)
    suppressed: int = 0
    duplicate_error: int = 0
    key_missing: int = 0


#: the table's columns and what they count (printed under the table)
COLUMNS = (
    ("published", "calls that took a lock (or needed none) and were sent to the broker"),
    ("suppressed", "duplicates: nothing sent, the holder's result returned"),
    ("dup_error", "duplicates refused with DuplicateTaskError (on_duplicate='raise')"),
    ("no_key", "calls refused with MissingDeduplicationKey (identity='caller_provided')"),
    ("run", "task bodies the worker ran (each writes a TaskRun row)"),
    ("released", "locks of published calls already gone at the end (policy or revoke)"),
)


class Command(BaseCommand):
    """Run the celery-dedup demo against a real worker."""

    help = "Start a worker, fire duplicate calls, tell what celery-dedup did, print a table."

    def add_arguments(self, parser: Any) -> None:
        """``--show-worker-log`` prints the worker's output at the end."""
        parser.add_argument("--show-worker-log", action="store_true",
                            help="Print the worker's log after the table.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Migrate, start the worker, run the scenarios, print the table."""
        from example_project.celery import app

        started = time.monotonic()
        call_command("migrate", interactive=False, verbosity=0)
        self._refuse_if_a_worker_runs(app)
        self._reset(app)
        log_path = Path(settings.VAR_DIR) / "demo-worker.log"
        self.stdout.write(
            f"broker {_scheme(app.conf.broker_url)}, results "
            f"{_scheme(app.conf.result_backend)}, locks in {_describe_store(app)}\n"
        )
        worker = self._start_worker(log_path)
        try:
            self._wait_for_worker(app, worker, log_path)
            tallies = self._scenarios()
            rows = self._summarise(app, tallies)
        finally:
            self._stop_worker(worker)
        self._print_table(rows)
        self.stdout.write(f"\ndone in {time.monotonic() - started:.1f}s")
        if options["show_worker_log"]:
            self.stdout.write(log_path.read_text())

    # -- setup -----------------------------------------------------------------

    def _refuse_if_a_worker_runs(self, app: Any) -> None:
        """Never touch a worker the user started: stop if one answers on this broker."""
        replies = app.control.ping(timeout=1.0)
        if replies:
            names = ", ".join(sorted(name for reply in replies for name in reply))
            raise CommandError(
                f"a worker is already running on this broker ({names}). The demo starts its "
                "own worker and clears the queue: stop that worker first, or run the demo "
                "with another EXAMPLE_VAR_DIR (or REDIS_URL database)."
            )

    def _reset(self, app: Any) -> None:
        """Start from a clean slate: no locks, no task runs, no queued messages."""
        from shop.models import TaskRun

        runtime = runtime_for(app)
        store = runtime.store
        if store is not None:
            for lock in store.scan(runtime.settings.key_prefix + ":"):
                store.release(lock.key, lock.owner)
        TaskRun.objects.all().delete()
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
        self.stdout.write("Starting a worker: " + " ".join(argv[1:]) + "\n")
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

    def _say(self, title: str, text: str) -> None:
        self.stdout.write(f"{title}\n" + textwrap.fill(text, width=78, initial_indent="  ",
                                                      subsequent_indent="  ") + "\n")

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
            except DuplicateTaskError:
                tally.duplicate_error += 1
                return None
            except MissingDeduplicationKey:
                tally.key_missing += 1
                return None
            if result.deduplicated:
                tally.suppressed += 1
            else:
                tally.published.append(result)
            return result

        for user_id in (1, 1, 1, 2):
            call("send_digest", user_id)
        self._say(
            "send_digest: user 1 asks for a digest three times, user 2 once.",
            "2 published, 2 suppressed. The key is digest:<user>:<UTC day> and the lock "
            "uses unique_until='expiry' with a 24-hour unique_for: at most one digest per "
            "user and day, even after it was sent (the lock lives 24 h from the first call).",
        )
        first_sync = call("sync_address", 42, HOME)
        call("sync_address", 42, HOME)
        call("sync_address", 42, {"street": "Unter den Linden 5", "zip": "10117"})
        self._say(
            "sync_address: the same sync twice, then another address.",
            "The second identical call is suppressed and gets the first one's result "
            "(same task id); another address is other work and is published. With "
            "unique_until='success' this holds while the first sync is pending or running.",
        )
        payment = call("process_payment", "pay-1001", "19.99", "EUR")
        call("process_payment", "pay-1001", "19.99", "EUR")
        self._say(
            "process_payment: a double submit of payment pay-1001.",
            "The second call raises DuplicateTaskError (on_duplicate='raise'); the shop's "
            "API turns it into HTTP 409, whose message never contains the other task's id.",
        )
        call("fulfill_order", 7, ["book"])
        call("fulfill_order", 7, ["book"], deduplication_key="order:key-7")
        call("fulfill_order", 7, ["book"], deduplication_key="order:key-7")
        self._say(
            "fulfill_order: an order without Idempotency-Key, then the same key twice.",
            "Without a key the call raises MissingDeduplicationKey (identity="
            "'caller_provided'); the same key twice is one order, remembered for 24 hours "
            "(unique_until='expiry') even after it was fulfilled.",
        )
        countdown = tasks.probe_countdown(0)
        probe = call("probe_server", "https://peer.example", 0, countdown=countdown)
        call("probe_server", "https://peer.example", 0, countdown=countdown)
        self._say(
            "probe_server: the same health check scheduled twice, 5 minutes ahead.",
            "One message, whose task id derives from the key (deterministic_id=True), so "
            "anyone can find its result from (server, attempt) alone.",
        )
        call("notify", 1, "export-ready")
        call("notify", 1, "export-ready")
        call("notify", 1, "welcome", deduplication_key="welcome:user-1")
        call("notify", 1, "welcome", deduplication_key="welcome:user-1")
        self._say(
            "notify: two 'export ready' mails, then a keyed welcome mail twice.",
            "Without a key both mails are sent: identity='always_unique' takes no lock. "
            "With the key welcome:user-1 the second welcome is suppressed; the lock "
            "outlives the mail (unique_until='expiry'), so a redelivered event never sends "
            "it twice.",
        )
        beat = {"headers": {"celery_beat_task": True}}
        call("purge_expired_locks", **beat)
        call("purge_expired_locks", **beat)
        self._say(
            "purge_expired_locks: two beat instances tick at the same moment.",
            "One run; the second tick is suppressed (beat never gets an exception).",
        )

        self._after_the_first_runs(call, payment, first_sync, probe)
        return tallies

    def _after_the_first_runs(
        self, call: Callable[..., Any], payment: Any, first_sync: Any, probe: Any
    ) -> None:
        """The scenarios that wait for a first run: what a finished run lets in."""
        charged = payment.get(timeout=RESULT_TIMEOUT, interval=0.1)
        call("process_payment", "pay-1001", "19.99", "EUR")
        self._say(
            f"process_payment: pay-1001 submitted again after the worker {charged}.",
            "Refused again with DuplicateTaskError: the charge ran once. The payment's "
            "idempotency key (payment:<id>) is locked with unique_until='expiry' for 24 "
            "hours, so a finished charge does not let the same payment in; under the "
            "default unique_until='success' it would have charged twice.",
        )
        first_sync.get(timeout=RESULT_TIMEOUT, interval=0.1)
        again = call("sync_address", 42, HOME)
        self._say(
            "sync_address again, after the first sync succeeded.",
            f"Published ({'a new task' if again is not None and not again.deduplicated else '?'})"
            ": the worker released the lock before it stored SUCCESS, so once get() returned "
            "the same call is new work. For 'never twice within a window', use "
            "unique_until='expiry'.",
        )
        outcome = revoke(probe)
        self._say(
            "probe_server: the probe is not needed after all; celery_dedup.revoke(probe).",
            f"{outcome.value.upper()}: it had not started, so its lock was released at once, "
            "and its owner token is marked revoked: the message can never run its body, "
            "even if a worker receives it later.",
        )

    # -- the table ---------------------------------------------------------------

    def _summarise(self, app: Any, tallies: dict[str, Tally]) -> list[tuple[str, ...]]:
        from shop import tasks
        from shop.models import TaskRun

        probe_ids = {result.id for result in tallies["probe_server"].published}
        for tally in tallies.values():
            for result in tally.published:
                if result.id not in probe_ids:  # scheduled minutes ahead: revoked, never runs
                    result.get(timeout=RESULT_TIMEOUT, interval=0.1)
        store = runtime_for(app).store
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
                if holder is None or holder.task_id != result.id:
                    released += 1
            rows.append((name, len(tally.published), tally.suppressed, tally.duplicate_error,
                         tally.key_missing, runs, released))
        return [tuple(str(cell) for cell in row) for row in rows]

    def _print_table(self, rows: list[tuple[str, ...]]) -> None:
        header = ("task", *(name for name, _ in COLUMNS))
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
        self.stdout.write("")
        for name, meaning in COLUMNS:
            self.stdout.write(f"{name:>10}: {meaning}")


def _scheme(url: Any) -> str:
    return str(url).split("://")[0] + "://"


def _describe_store(app: Any) -> str:
    """The lock store in words, with its URL's secrets masked."""
    store = runtime_for(app).store
    url = derive_store_url(app) or "none"
    if store is None:
        return "no lock store"
    if url.startswith("django-db"):
        return "the project's database (django-db store, table celery_dedup_lock)"
    return f"the {store.name} store at {maybe_sanitize_url(url)}"
