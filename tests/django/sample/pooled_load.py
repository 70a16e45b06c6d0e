"""Run in a fresh process: a pooled PostgreSQL project under a threaded server and a worker.

Prints one JSON line: executions per key, errors, and the most connections
the project's database ever had (``pg_stat_activity``), plus the count after.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample.settings")
django.setup()

import psycopg  # noqa: E402
from celery.contrib.testing.worker import start_worker  # noqa: E402
from django.core.signals import request_finished, request_started  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from sample.celery import app  # noqa: E402
from sample.tasks import record  # noqa: E402

NAME = connection.settings_dict["NAME"]
PORT = int(connection.settings_dict["PORT"])
THREADS, REQUESTS, KEYS = 16, 160, 8
peak = [0]
stop = threading.Event()


def _connections(observer: psycopg.Connection) -> int:
    # Client connections only: an autovacuum worker (the lock table churns)
    # or a parallel worker also shows the database's name.
    row = observer.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend'",
        [NAME],
    ).fetchone()
    return int(row[0]) if row else 0


def _watch() -> None:
    with psycopg.connect(
        host="127.0.0.1", port=PORT, user="postgres", dbname=NAME, autocommit=True
    ) as observer:
        while not stop.is_set():
            peak[0] = max(peak[0], _connections(observer))
            time.sleep(0.005)


def _request(i: int) -> str:
    """One request of a threaded server: ATOMIC_REQUESTS-like, a query, then a call."""
    request_started.send(sender=None)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            record.delay(f"key-{i % KEYS}")
            # The site's own query after the call still gets its connection.
            cursor.execute("SELECT count(*) FROM celery_dedup_lock")
        record.delay(f"key-{i % KEYS}")  # outside atomic: Django's own connection
        return "ok"
    except Exception as exc:  # reported, not raised: the parent asserts on it
        return f"{type(exc).__name__}: {exc}"
    finally:
        request_finished.send(sender=None)


def main() -> None:
    watcher = threading.Thread(target=_watch, daemon=True)
    watcher.start()
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                      shutdown_timeout=30):
        with ThreadPoolExecutor(THREADS) as pool:
            outcomes = list(pool.map(_request, range(REQUESTS)))
        deadline = time.monotonic() + 60
        from sample.tasks import EXECUTED

        while time.monotonic() < deadline and len(EXECUTED) < KEYS:
            time.sleep(0.05)
        time.sleep(0.5)
    stop.set()
    watcher.join(5)
    with psycopg.connect(
        host="127.0.0.1", port=PORT, user="postgres", dbname=NAME, autocommit=True
    ) as observer:
        pool = connection.pool
        stats = pool.get_stats() if pool is not None else {}
        after = _connections(observer)
    json.dump({
        "errors": sorted({o for o in outcomes if o != "ok"}),
        "executed": dict(sorted(EXECUTED.items())),
        "peak": peak[0],
        "after": after,
        "pool_size": stats.get("pool_size"),
        "pool_available": stats.get("pool_available"),
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
