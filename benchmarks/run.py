"""Benchmarks of celery-dedup against plain Celery, raw drivers, celery-once and celery-singleton.

Run from the repository root::

    python benchmarks/run.py            # full run (a few minutes: loads 1 000 000 locks)
    python benchmarks/run.py --smoke    # seconds: small N, 10 000 locks instead of 1 000 000
    python benchmarks/run.py --runs 5 --publish   # what docs/benchmarks.md shows

It installs the ``bench`` extra's peers (celery-once, celery-singleton) when
they are missing, starts its own redis-servers (broker, lock store) and a
postgres on free loopback ports, measures everything as ratios in one run,
prints a table and writes JSON (default ``benchmarks/results/latest.json``);
when that file exists, the run is first compared with it, row by row, and
it is kept as ``previous.json``. ``--runs N`` makes N whole runs, each on
fresh servers, and reports every row and target as the median of the runs
with their spread (lowest and highest); ``--publish`` writes that JSON
beside the docs page (``docs/benchmarks.json``, compared with the one it
replaces) and the table into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import importlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from benchmarks.servers import postgres_server, redis_server, stop  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
#: the published results, beside the page that shows them
PUBLISHED = ROOT / "docs" / "benchmarks.json"
PAGE = ROOT / "docs" / "benchmarks.md"
#: the published table sits between these lines of ``PAGE``
TABLE_START = "<!-- benchmark table: written by benchmarks/run.py --publish -->"
TABLE_END = "<!-- end of the benchmark table -->"

#: every row a run produces, in table order
ROWS = (
    "a_plain_apply_async", "b_raw_set_nx_px_held", "g_set_nx_plus_apply_async",
    "c_dedup_first", "d_dedup_duplicate", "once_first", "once_duplicate",
    "singleton_first", "singleton_duplicate", "e_worker_plain", "e_worker_dedup",
    "f_acquire_small", "f_acquire_large", "f_bytes_per_lock", "f_bytes_per_lock_info",
    "h_postgres_store", "h_postgres_raw", "h_sqlite_store", "h_sqlite_raw",
    "l_lease_pass_1000", "l_lease_one_by_one_1000", "l_lease_ms_per_s",
    "k_handoff_wall_vs_ideal", "k_handoff_in_call_order",
    "m_bulk_per_item_1000", "m_bulk_single_calls_1000", "m_bulk_plain_group_1000",
)
ROUND_TRIPS = (
    "acquire", "duplicate", "acquire_rated", "duplicate_rated", "release", "release_api",
    "executed", "bulk_1000",
)

# -- dependencies -------------------------------------------------------------


def ensure_bench_dependencies() -> None:
    """Install the ``bench`` extra's requirements (setup.cfg) when one is missing."""
    try:
        import celery_once  # noqa: F401
        import celery_singleton  # noqa: F401
    except ImportError:
        parser = configparser.ConfigParser()
        parser.read(ROOT / "setup.cfg")
        requirements = parser["options.extras_require"]["bench"].split()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requirements], check=True)


# -- measuring ----------------------------------------------------------------


def best_us(
    op: Callable[[int], object],
    iterations: int,
    rounds: int,
    after_round: Callable[[], object] | None = None,
) -> float:
    """Best (lowest) mean µs per ``op(i)`` over ``rounds`` rounds (``i`` never repeats)."""
    counter = itertools.count()
    for _ in range(min(50, iterations)):  # warm up: connections, scripts, caches
        op(next(counter))
    if after_round is not None:
        after_round()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            op(next(counter))
        best = min(best, (time.perf_counter() - start) / iterations)
        if after_round is not None:
            after_round()
    return best * 1e6


def alternating_us(
    ops: dict[str, Callable[[int], object]],
    iterations: int,
    rounds: int,
    after_round: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median over ``rounds`` of each op's mean µs, the ops called in turn one call at a time.

    For two ops whose ratio is the result: each call of one is next to a
    call of the other, so a burst of load (another process, a timer) hits
    both sides alike, and the median keeps a single lucky or unlucky round
    out of the ratio (a best-of-rounds does not: one quiet round on one
    side alone moves it).
    """
    counter = itertools.count()
    for _ in range(min(50, iterations)):
        for op in ops.values():
            op(next(counter))
    clock = time.perf_counter
    per_round: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        spent = dict.fromkeys(ops, 0.0)
        for _ in range(iterations):
            for name, op in ops.items():
                i = next(counter)
                start = clock()
                op(i)
                spent[name] += clock() - start
        for name, total in spent.items():
            per_round[name].append(total / iterations * 1e6)
        if after_round is not None:
            after_round()
    return {name: statistics.median(values) for name, values in per_round.items()}


class ServerCounter:
    """What one Redis server processed between two snapshots (``INFO``)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def snapshot(self) -> tuple[int, dict[str, int]]:
        """``(total_reads_processed, {command: calls})`` now."""
        info = self.client.info("all")
        calls = {
            name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in info.items()
            if name.startswith("cmdstat_")
        }
        return int(info["total_reads_processed"]), calls

    @contextlib.contextmanager
    def counting(self, count: int, into: dict[str, Any]) -> Iterator[None]:
        """Fill ``into`` with round trips and client commands per op over the block."""
        reads_before, calls_before = self.snapshot()
        yield
        reads_after, calls_after = self.snapshot()
        # The second INFO is itself one read and one "info" call.
        into["round_trips"] = (reads_after - reads_before - 1) / count
        into["commands"] = {
            name: (calls - calls_before.get(name, 0)) / count
            for name, calls in sorted(calls_after.items())
            if name != "info" and calls != calls_before.get(name, 0)
        }


def load_app(broker_url: str, store_url: str) -> ModuleType:
    """``benchmarks.app`` configured for these servers (re-imported when already loaded)."""
    os.environ.update(BENCH_BROKER=broker_url, BENCH_STORE=store_url, BENCH_RESULTS="")
    module = sys.modules.get("benchmarks.app")
    return importlib.reload(module) if module else importlib.import_module("benchmarks.app")


# -- the sections ---------------------------------------------------------------


def enqueue_rows(bench: ModuleType, store_url: str, n: int, rounds: int) -> dict[str, float]:
    """a, b, g, c, d and the peers' first enqueue and duplicate, µs per call.

    The first enqueues of all five alternate call by call, then the
    duplicates and the raw ``SET NX`` (``alternating_us``): every ratio
    between them is taken under the same load.
    """
    app, plain, dedup = bench.app, bench.plain, bench.dedup
    once, singleton = bench.peer_tasks()
    raw = redis.Redis.from_url(store_url)
    ttl_ms = bench.LOCK_SECONDS * 1000

    def purge() -> None:
        app.control.purge()
        raw.flushdb()

    def set_and_publish(i: int) -> None:
        if raw.set(f"bench:g:{i}", "owner", nx=True, px=ttl_ms):
            plain.apply_async((i,))

    rows = alternating_us(
        {
            "a_plain_apply_async": lambda i: plain.apply_async((i,)),
            "g_set_nx_plus_apply_async": set_and_publish,
            "c_dedup_first": lambda i: dedup.apply_async((i,)),
            "once_first": lambda i: once.apply_async((i,)),
            "singleton_first": lambda i: singleton.apply_async((i,)),
        },
        n, rounds, purge,
    )
    raw.set("bench:b:held", "holder", px=ttl_ms)
    duplicates: dict[str, Callable[[int], object]] = {
        "b_raw_set_nx_px_held": lambda i: raw.set("bench:b:held", "other", nx=True, px=ttl_ms),
    }
    for name, task in (("d_dedup", dedup), ("once", once), ("singleton", singleton)):
        first = task.apply_async((-1,))
        duplicate = task.apply_async((-1,))
        # each library's own way of saying "not published": the holder's id, or none
        assert duplicate.id in (first.id, None), name
        duplicates[f"{name}_duplicate"] = lambda i, t=task: t.apply_async((-1,))
    rows.update(alternating_us(duplicates, n, rounds))
    assert dedup.apply_async((-1,)).deduplicated is True
    purge()
    raw.close()
    return rows


def round_trip_rows(bench: ModuleType, store_url: str, count: int) -> dict[str, Any]:
    """Store round trips per acquire, duplicate and release, counted on the server."""
    from celery_dedup import release
    from celery_dedup.results import owner_of
    from celery_dedup.runtime import runtime_for

    counter = ServerCounter(store_url)
    from celery_dedup import enqueue_many

    trips: dict[str, Any] = {name: {} for name in ROUND_TRIPS if name != "executed"}
    acquired: list[Any] = []
    with counter.counting(count, trips["acquire"]):
        for i in range(count):
            acquired.append(bench.dedup.apply_async((10**9 + i,)))
    assert all(result.deduplicated is False for result in acquired)
    with counter.counting(count, trips["duplicate"]):
        for i in range(count):
            bench.dedup.apply_async((10**9 + i,))
    bench.rated.apply_async((-1,))  # load the rate scripts: no SCRIPT LOAD counted
    with counter.counting(count, trips["acquire_rated"]):
        for i in range(count):
            assert bench.rated.apply_async((10**9 + i,)).deduplicated is False
    with counter.counting(count, trips["duplicate_rated"]):
        for i in range(count):
            assert bench.rated.apply_async((10**9 + i,)).deduplicated is True
    store = runtime_for(bench.app).store
    assert store is not None
    store.get("bench:warm")  # load the scripts the releases use: no SCRIPT LOAD counted
    store.release("bench:warm", "nobody")
    half = count // 2
    with counter.counting(half, trips["release"]):  # what the worker does at the end
        for result in acquired[:half]:
            assert store.release(result.deduplication_key, owner_of(result))
    with counter.counting(count - half, trips["release_api"]):  # looks the holder up first
        for result in acquired[half:]:
            assert release(result, app=bench.app)
    enqueue_many([bench.dedup.s(-3)], per_item=True, app=bench.app)  # loads its script
    batch = [bench.dedup.s(2 * 10**9 + bulk_key(i)) for i in range(BULK_ITEMS)]
    bulk = trips["bulk_1000"]
    with counter.counting(1, bulk):  # one enqueue_many(per_item=True)
        outcomes = enqueue_many(batch, per_item=True, app=bench.app)
    assert len(outcomes.with_status("published")) == BULK_DISTINCT
    # Its one request (~100 KB) reaches the server in several reads: the round
    # trips are the commands the client sent (the scripts' own are in commandstats).
    bulk["server_reads"] = bulk["round_trips"]
    bulk["round_trips"] = bulk["commands"].get("evalsha", 0)
    bench.app.control.purge()
    counter.client.flushdb()
    counter.client.close()
    return trips


#: the bulk rows' batch: 1,000 items, every tenth repeating an earlier item's key
BULK_ITEMS = 1000
BULK_DISTINCT = 900
#: targets: per_item at least this many times faster than the single calls, and at
#: most this many times a plain group's time
BULK_SPEEDUP = 2.0
BULK_OVER_GROUP = 1.2


def bulk_key(i: int) -> int:
    """Item ``i``'s argument in a bulk batch (900 distinct, 100 repeats)."""
    return i if i < BULK_DISTINCT else (i * 7) % BULK_DISTINCT


def bulk_rows(bench: ModuleType, store_url: str, n: int, rounds: int) -> dict[str, float]:
    """A batch of 1,000 items with 10% repeated keys, ms per batch, in turn: one
    ``enqueue_many(per_item=True)``, 1,000 ``DedupTask.apply_async`` calls, and a plain
    ``group(...).apply_async()`` of 1,000 plain tasks (no deduplication: the floor)."""
    from celery import group

    from celery_dedup import enqueue_many

    app, plain, dedup = bench.app, bench.plain, bench.dedup
    raw = redis.Redis.from_url(store_url)

    def purge() -> None:
        app.control.purge()
        raw.flushdb()

    def batch(i: int) -> list[int]:  # fresh keys for every batch
        return [(i + 1) * 10**6 + bulk_key(j) for j in range(BULK_ITEMS)]

    def per_item(i: int) -> None:
        enqueue_many([dedup.s(x) for x in batch(i)], per_item=True, app=app)

    def single_calls(i: int) -> None:
        for x in batch(i):
            dedup.apply_async((x,))

    def plain_group(i: int) -> None:
        group(plain.s(x) for x in batch(i)).apply_async()

    rows = alternating_us(
        {
            "m_bulk_per_item_1000": per_item,
            "m_bulk_single_calls_1000": single_calls,
            "m_bulk_plain_group_1000": plain_group,
        },
        n, rounds, purge,
    )
    purge()
    raw.close()
    return {name: us / 1000 for name, us in rows.items()}


def worker_rows(
    bench: ModuleType,
    broker_url: str,
    store_url: str,
    tasks: int,
    trips: dict[str, Any],
    rounds: int = 5,
) -> dict[str, float]:
    """Tasks per second through a real prefork worker: plain vs DedupTask (with claim + release).

    For each round the queue is filled while the worker consumes nothing,
    then consumption starts; the rate is the tasks completed between the
    first and the last result stored (their ``date_done``), so neither the
    control broadcast that starts the run nor the polling for its end (kept
    sparse: it takes no CPU from the worker) is counted. Plain and DedupTask
    rounds alternate, each first in every other pair, so a load spike or a
    warming cache costs both alike; each row is its best round, as for
    every other row.
    """
    results_url = broker_url.rsplit("/", 1)[0] + "/1"
    results = redis.Redis.from_url(results_url)
    app = bench.app
    with bench_worker(bench, 2, {"BENCH_RESULTS": results_url}):
        try:
            counter = ServerCounter(store_url)
            first = itertools.count(0, tasks)

            def drain(task: Any, count: int, start_at: int) -> float:
                """Fill the queue with ``count`` calls, then time the worker emptying it."""
                app.control.cancel_consumer(bench.QUEUE, reply=True, timeout=5, limit=1)
                results.flushdb()
                for i in range(start_at, start_at + count):
                    task.apply_async((i,))
                app.control.add_consumer(bench.QUEUE, reply=True, timeout=5, limit=1)
                while results.dbsize() < count:
                    time.sleep(0.02)
                done = sorted(
                    datetime.fromisoformat(json.loads(meta or "{}")["date_done"]).timestamp()
                    for meta in results.mget(list(results.scan_iter(count=1000)))
                )
                return (count - 1) / (done[-1] - done[0])

            def counted_drain(task: Any) -> float:
                """``drain``, counting the store round trips of each executed task."""
                executed: dict[str, Any] = {}
                with counter.counting(tasks, executed):
                    rate = drain(task, tasks, next(first))
                # the tasks' acquires were counted too: one round trip each
                acquire = trips["acquire"]
                executed["round_trips"] -= acquire["round_trips"]
                commands = executed["commands"]
                executed["commands"] = {
                    k: v - acquire["commands"].get(k, 0) for k, v in commands.items()
                    if v != acquire["commands"].get(k, 0)
                }
                trips["executed"] = executed
                return rate

            pairs = [("e_worker_plain", bench.plain), ("e_worker_dedup", bench.dedup)]
            for _, task in pairs:
                drain(task, 20, -100)  # warm up: pool children connect, load scripts
            rows = {name: 0.0 for name, _ in pairs}
            for round_ in range(rounds):
                for name, task in pairs if round_ % 2 == 0 else pairs[::-1]:
                    if round_ == 0 and task is bench.dedup:
                        rate = counted_drain(task)
                    else:
                        rate = drain(task, tasks, next(first))
                    rows[name] = max(rows[name], rate)
            left = [  # done markers (run records) stay by design: locks must not
                k for k in counter.client.scan_iter(f"*{bench.DEDUP_NAME}*") if b":run" not in k
            ]
            assert not left, "locks left"
            counter.client.close()
        finally:
            results.close()
    return rows


@contextlib.contextmanager
def bench_worker(bench: ModuleType, concurrency: int, env: dict[str, str]) -> Iterator[None]:
    """A prefork worker of the bench app on its queue, ready (pinged), stopped at the end."""
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "celery", "-A", "benchmarks.app", "worker", "-P", "prefork",
            "-c", str(concurrency), "-Q", bench.QUEUE, "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "WARNING"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not bench.app.control.ping(timeout=0.5):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the worker did not start: {log.read()[-2000:]!r}")
            yield
        finally:
            stop(proc)


def handoff_rows(bench: ModuleType, store_url: str, calls: int, seconds: float) -> dict[str, float]:
    """``calls`` bodies of ``seconds`` for one key at ``concurrency_limit=1``, through a real
    prefork worker of 4 processes: the wall time over the ideal ``calls * seconds``, and
    whether the bodies ran in call order (1) or not (0).

    The first call is published, and the others once its body started: they find
    the slot held and wait for it (a call that finds a slot free runs at once). The
    wall time runs from the first publish to the end of the last body.
    """
    marks = redis.Redis.from_url(store_url)
    marks.delete(bench.SERIAL_STARTED, bench.SERIAL_ENDED)
    with bench_worker(bench, 4, {}):
        try:
            key = f"handoff-{time.time_ns()}"
            start = time.monotonic()
            bench.serial.delay(key, 0, seconds)
            while not marks.llen(bench.SERIAL_STARTED):
                time.sleep(0.005)
            for n in range(1, calls):
                bench.serial.delay(key, n, seconds)
            deadline = time.monotonic() + calls * seconds * 10 + 60
            while marks.llen(bench.SERIAL_ENDED) < calls:
                if time.monotonic() > deadline:
                    raise RuntimeError("the serial calls did not all run")
                time.sleep(0.01)
            wall = time.monotonic() - start
            started = [int(n) for n in marks.lrange(bench.SERIAL_STARTED, 0, -1)]
        finally:
            marks.close()
    return {
        "k_handoff_wall_vs_ideal": wall / (calls * seconds),
        "k_handoff_in_call_order": float(started == list(range(calls))),
    }


def lease_rows(bench: ModuleType, store_url: str, running: int, rounds: int) -> dict[str, Any]:
    """Lease upkeep of a worker running ``running`` long tasks at once.

    Each task's lease is taken as its start claim takes it; a pass renews
    them all in one pipelined round trip (what ``celery_dedup.leases`` does
    every third of the lease), compared with renewing them one round trip
    each. ``l_lease_ms_per_s`` is the upkeep's cost per second of wall clock
    at the default 60 s lease (a pass every 20 s).
    """
    from celery_dedup.runs import records_of
    from celery_dedup.runtime import runtime_for
    from celery_dedup.stores.base import RunRef

    store = runtime_for(bench.app).store
    assert store is not None
    records = records_of(store)
    meta = {"task_name": bench.DEDUP_NAME, "policy": "success", "task_id": "lease-bench"}
    runs = [RunRef(f"lease-bench:{i}", f"owner-{i}", "0.0", f"copy-{i}") for i in range(running)]
    for run in runs:
        records.claim_run(run, 60, meta, release=False, ttl=60)
    assert records.renew_runs(runs, 60) == running  # every lease is held

    def one_by_one(_: int) -> None:
        for run in runs:
            records.renew_runs([run], 60)

    pass_us = best_us(lambda _: records.renew_runs(runs, 60), 1, rounds)
    sequential_us = best_us(one_by_one, 1, rounds)
    redis.Redis.from_url(store_url).flushdb()
    return {
        "l_lease_pass_1000": pass_us,
        "l_lease_one_by_one_1000": sequential_us,
        "l_lease_ms_per_s": pass_us / 1000 / 20,
    }


FILL = """
local last = tonumber(ARGV[2]) + tonumber(ARGV[3]) - 1
for i = tonumber(ARGV[2]), last do
    local h = string.sub(redis.sha1hex(tostring(i)), 1, 32)
    redis.call('restore', ARGV[4] .. h, ARGV[5], ARGV[1])
end
return last
"""


def scale_rows(bench: ModuleType, store_url: str, small: int, large: int, n: int,
               rounds: int) -> dict[str, float]:
    """Acquire µs at ``small`` vs ``large`` live locks; bytes per live lock.

    The locks are copies (``DUMP``/``RESTORE``, in batches run by a Lua
    script) of a real lock taken by ``DedupTask``, so they have its layout.
    The small and the large set live on two servers at once; their acquires
    alternate call by call and each row is the median of the rounds
    (``alternating_us``), the locks a round took deleted after it.
    """
    from celery_dedup.stores.redis import RedisStore

    raw = redis.Redis.from_url(store_url)
    raw.flushdb()
    holder = bench.dedup.apply_async((-7,))
    key = holder.deduplication_key
    rows = {"f_bytes_per_lock": float(raw.memory_usage(key, samples=0) or 0)}
    dump = raw.dump(key)
    prefix = key.rsplit(":", 1)[0] + ":"
    meta = {"task_name": bench.DEDUP_NAME, "policy": "success", "task_id": "t" * 36}
    keys = itertools.count()

    def fill_to(client: redis.Redis, total: int) -> None:
        fill = client.register_script(FILL)
        loaded = client.dbsize()
        while loaded < total:
            batch = min(20_000, total - loaded)
            fill(args=[dump, loaded, batch, prefix, bench.LOCK_SECONDS * 1000])
            loaded += batch

    with redis_server() as large_url:
        big = redis.Redis.from_url(large_url)
        fill_to(raw, small)
        used_before, size_before = big.info("memory")["used_memory"], big.dbsize()
        fill_to(big, large)
        used_after, size_after = big.info("memory")["used_memory"], big.dbsize()
        rows["f_bytes_per_lock_info"] = (used_after - used_before) / (size_after - size_before)
        stores = {"f_acquire_small": RedisStore.from_url(store_url),
                  "f_acquire_large": RedisStore.from_url(large_url)}

        taken: dict[str, list[str]] = {row: [] for row in stores}

        def acquire_on(row: str, store: RedisStore) -> Callable[[int], object]:
            def acquire(_: int) -> None:
                key = f"{prefix}{next(keys):032x}"
                store.acquire(key, "f" * 22, bench.LOCK_SECONDS, meta)
                taken[row].append(key)
            return acquire

        def back_to_size() -> None:
            # The measured locks are deleted after each round: the keyspaces
            # stay at ``small`` and ``large`` (no table grows during the run).
            for row, client in (("f_acquire_small", raw), ("f_acquire_large", big)):
                for start in range(0, len(taken[row]), 1000):
                    client.delete(*taken[row][start:start + 1000])
                taken[row].clear()

        rows.update(alternating_us(
            {row: acquire_on(row, store) for row, store in stores.items()}, n, max(rounds, 5),
            back_to_size,
        ))
        for store in stores.values():
            store.close()
        big.close()
    raw.flushdb()
    raw.close()
    return rows


def sql_rows(postgres_url: str, n: int, rounds: int) -> dict[str, float]:
    """SQLStore.acquire vs a raw ``INSERT … ON CONFLICT DO NOTHING`` on Postgres and SQLite."""
    from sqlalchemy import create_engine, text

    from celery_dedup.stores.sql import SQLStore

    rows: dict[str, float] = {}
    meta = {"task_name": "bench.sql", "policy": "success", "task_id": "t" * 36}
    with tempfile.TemporaryDirectory(prefix="celery-dedup-bench-sqlite-") as directory:
        for name, url in (("postgres", postgres_url), ("sqlite", f"sqlite:///{directory}/b.db")):
            store = SQLStore(url, reap_interval=0)
            store.acquire("warm", "owner", 60, meta)  # creates the tables
            engine = create_engine(url, isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(text("CREATE TABLE raw_locks (key VARCHAR(255) PRIMARY KEY, "
                                  "owner VARCHAR(64) NOT NULL, expires FLOAT NOT NULL)"))
            upsert = text("INSERT INTO raw_locks (key, owner, expires) VALUES (:k, :o, :e) "
                          "ON CONFLICT DO NOTHING")

            def raw_insert(i: int, engine: Any = engine, upsert: Any = upsert) -> None:
                with engine.connect() as conn:
                    conn.execute(upsert, {"k": f"k{i}", "o": "owner", "e": time.time() + 60})

            def store_acquire(i: int, store: SQLStore = store) -> None:
                store.acquire(f"k{i}", "owner", 60, meta)

            rows[f"h_{name}_raw"] = best_us(raw_insert, n, rounds)
            rows[f"h_{name}_store"] = best_us(store_acquire, n, rounds)
            engine.dispose()
            store.engine.dispose()
    return rows


# -- the run --------------------------------------------------------------------


def run(*, smoke: bool = False, iterations: int | None = None, rounds: int | None = None,
        worker_tasks: int | None = None) -> dict[str, Any]:
    """Start the servers, run every section, return the results (no printing)."""
    ensure_bench_dependencies()
    import celery
    import celery_once  # noqa: F401
    import celery_singleton  # noqa: F401

    import celery_dedup

    n = iterations or (30 if smoke else 2000)
    r = rounds or (1 if smoke else 5)
    tasks = worker_tasks or (50 if smoke else 2000)
    small, large = (1_000, 10_000) if smoke else (1_000, 1_000_000)
    with redis_server() as broker_url, redis_server() as store_url:
        bench = load_app(broker_url, store_url)
        try:
            rows = enqueue_rows(bench, store_url, n, r)
            trips = round_trip_rows(bench, store_url, min(n, 200))
            rows.update(worker_rows(bench, broker_url, store_url, tasks, trips))
            rows.update(scale_rows(bench, store_url, small, large, n, r))
            rows.update(lease_rows(bench, store_url, 1000, r))
            rows.update(handoff_rows(bench, store_url, 10, 0.2 if smoke else 1.0))
            rows.update(bulk_rows(bench, store_url, 1 if smoke else 3, r))
            server = redis.Redis.from_url(store_url).info("server")["redis_version"]
        finally:
            bench.app.close()
    with postgres_server() as postgres_url:
        rows.update(sql_rows(postgres_url, min(n, 500), r))
    return {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "smoke": smoke, "iterations": n, "rounds": r, "worker_tasks": tasks,
            "live_locks": [small, large], "python": platform.python_version(),
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "celery": celery.__version__, "redis_py": redis.__version__,
            "redis_server": server, "celery_dedup": celery_dedup.__version__,
            "celery_once": _version("celery-once"),
            "celery_singleton": _version("celery-singleton"),
        },
        "rows": rows,
        "round_trips": trips,
        "targets": targets(rows, trips),
    }


def meets(value: float, op: str, bound: float) -> bool:
    """Whether ``value`` is within a target's bound (``op``: ``">="`` or ``"<="``)."""
    return value >= bound if op == ">=" else value <= bound


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one: each row and target the median of the runs, with its
    spread (the lowest and the highest run) and every run's figure."""
    if len(runs) == 1:
        return runs[0]
    rows = {key: statistics.median(run["rows"][key] for run in runs) for key in ROWS}
    spread = {key: [min(run["rows"][key] for run in runs), max(run["rows"][key] for run in runs)]
              for key in ROWS}
    combined_targets = []
    for i, first in enumerate(runs[0]["targets"]):
        values = [run["targets"][i]["value"] for run in runs]
        value = statistics.median(values)
        op, bound = first["bound"].split()
        combined_targets.append({
            "target": first["target"], "value": value, "bound": first["bound"],
            "met": meets(value, op, float(bound)),
            "runs": values,
        })
    # Round trips are counts: every run must agree, or the table says the highest.
    trips = {
        name: max((run["round_trips"][name] for run in runs), key=lambda t: t["round_trips"])
        for name in ROUND_TRIPS
    }
    meta = dict(runs[0]["meta"])
    meta.update(runs=len(runs), dates=[run["meta"]["date"] for run in runs])
    return {"meta": meta, "rows": rows, "spread": spread, "round_trips": trips,
            "targets": combined_targets}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def targets(rows: dict[str, float], trips: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: the measured figure, the bound and whether it is met."""
    def speed(x: str, over: str) -> float:  # how many times faster x is than ``over``
        return rows[over] / rows[x]

    def more_trips(name: str) -> float:  # store round trips a rate limit adds to a call
        return float(trips[f"{name}_rated"]["round_trips"] - trips[name]["round_trips"])

    first_peer = min(rows["once_first"], rows["singleton_first"])
    duplicate_peer = min(rows["once_duplicate"], rows["singleton_duplicate"])
    checks = [
        ("first enqueue vs g (speed)", speed("c_dedup_first", "g_set_nx_plus_apply_async"),
         ">=", 0.95),
        ("first enqueue vs the faster peer", first_peer / rows["c_dedup_first"], ">=", 1.05),
        ("duplicate vs b, one SET NX (speed)", speed("d_dedup_duplicate", "b_raw_set_nx_px_held"),
         ">=", 0.8),
        ("duplicate vs the faster peer", duplicate_peer / rows["d_dedup_duplicate"], ">=", 1.5),
        ("rate limit: trips added, first", more_trips("acquire"), "<=", 1.0),
        ("rate limit: trips added, duplicate", more_trips("duplicate"), "<=", 1.0),
        ("worker throughput vs plain", rows["e_worker_dedup"] / rows["e_worker_plain"],
         ">=", 0.93),
        ("acquire at large vs small", rows["f_acquire_large"] / rows["f_acquire_small"],
         "<=", 1.2),
        ("bytes per live lock", rows["f_bytes_per_lock"], "<=", 200.0),
        ("postgres acquire vs raw upsert", rows["h_postgres_store"] / rows["h_postgres_raw"],
         "<=", 1.5),
        ("sqlite acquire vs raw upsert", rows["h_sqlite_store"] / rows["h_sqlite_raw"],
         "<=", 1.5),
        ("lease pass vs one round trip per task", rows["l_lease_pass_1000"]
         / rows["l_lease_one_by_one_1000"], "<=", 0.5),
        ("bulk per_item vs 1,000 single calls", speed("m_bulk_per_item_1000",
         "m_bulk_single_calls_1000"), ">=", BULK_SPEEDUP),
        ("bulk per_item vs plain group (time)", rows["m_bulk_per_item_1000"]
         / rows["m_bulk_plain_group_1000"], "<=", BULK_OVER_GROUP),
    ]
    return [
        {"target": name, "value": value, "bound": f"{op} {bound:g}",
         "met": meets(value, op, bound)}
        for name, value, op, bound in checks
    ]


LABELS = {
    "a_plain_apply_async": ("(a) plain Task.apply_async", "µs"),
    "b_raw_set_nx_px_held": ("(b) raw SET NX PX (held key)", "µs"),
    "g_set_nx_plus_apply_async": ("(g) SET NX + plain apply_async", "µs"),
    "c_dedup_first": ("(c) DedupTask first enqueue", "µs"),
    "d_dedup_duplicate": ("(d) DedupTask duplicate", "µs"),
    "once_first": ("    celery-once first enqueue", "µs"),
    "once_duplicate": ("    celery-once duplicate", "µs"),
    "singleton_first": ("    celery-singleton first enqueue", "µs"),
    "singleton_duplicate": ("    celery-singleton duplicate", "µs"),
    "e_worker_plain": ("(e) worker, plain task", "tasks/s"),
    "e_worker_dedup": ("    worker, DedupTask", "tasks/s"),
    "f_acquire_small": ("(f) acquire, few live locks", "µs"),
    "f_acquire_large": ("    acquire, many live locks", "µs"),
    "f_bytes_per_lock": ("    bytes per lock (MEMORY USAGE)", "B"),
    "f_bytes_per_lock_info": ("    bytes per lock (INFO delta)", "B"),
    "h_postgres_store": ("(h) SQLStore.acquire, Postgres", "µs"),
    "h_postgres_raw": ("    raw INSERT ON CONFLICT, Postgres", "µs"),
    "h_sqlite_store": ("    SQLStore.acquire, SQLite", "µs"),
    "h_sqlite_raw": ("    raw INSERT ON CONFLICT, SQLite", "µs"),
    "l_lease_pass_1000": ("(l) lease upkeep pass, 1,000 running", "µs"),
    "l_lease_one_by_one_1000": ("    1,000 leases, one round trip each", "µs"),
    "l_lease_ms_per_s": ("    upkeep per second (60 s lease)", "ms/s"),
    "k_handoff_wall_vs_ideal": ("(k) 10 bodies of 1 s, limit 1: wall/ideal", "x"),
    "k_handoff_in_call_order": ("    ran in call order (1 yes, 0 no)", ""),
    "m_bulk_per_item_1000": ("(m) 1,000 items, 10% repeats: per_item", "ms"),
    "m_bulk_single_calls_1000": ("    1,000 DedupTask.apply_async calls", "ms"),
    "m_bulk_plain_group_1000": ("    plain group().apply_async()", "ms"),
}


def format_table(results: dict[str, Any]) -> str:
    """The results as a plain-text table (µs rows also as speed relative to a)."""
    rows, m = results["rows"], results["meta"]
    spread = results.get("spread", {})
    runs = f" · median of {m['runs']} runs (lowest to highest)" if "runs" in m else ""
    floor = rows["a_plain_apply_async"]
    lines = [
        f"celery-dedup {m['celery_dedup']} · celery {m['celery']} · redis-server "
        f"{m['redis_server']} · Python {m['python']} · {m['cpus']} CPUs · n={m['iterations']}, "
        f"{m['rounds']} rounds · live locks {m['live_locks'][0]:,} / {m['live_locks'][1]:,}"
        + runs,
        "",
    ]
    for key in ROWS:
        label, unit = LABELS[key]
        ratio = f"{floor / rows[key]:.2f}x a" if unit == "µs" and key < "e" else ""
        low_high = (f"{spread[key][0]:,.1f} to {spread[key][1]:,.1f}" if key in spread else "")
        lines.append(f"{label:<38} {rows[key]:>12,.1f} {unit:<8} {ratio:<8} {low_high}".rstrip())
    lines.append("")
    for name in ROUND_TRIPS:
        trip = results["round_trips"][name]
        cmds = ", ".join(f"{k} {v:g}" for k, v in trip["commands"].items())
        lines.append(f"store round trips per {name:<16} {trip['round_trips']:>6g}   {cmds}")
    lines.append("")
    for target in results["targets"]:
        state = "met" if target["met"] else "MISSED"
        values = target.get("runs")
        low_high = f"  ({min(values):.2f} to {max(values):.2f})" if values else ""
        lines.append(f"{target['target']:<38} {target['value']:>9.2f} {target['bound']:<8} "
                     f"{state}{low_high}")
    return "\n".join(lines)


def format_comparison(previous: dict[str, Any], results: dict[str, Any]) -> str:
    """Each row and target of ``results`` beside the same in ``previous`` (an earlier run)."""
    before, after = previous.get("rows", {}), results["rows"]
    m = previous.get("meta", {})
    lines = [
        f"compared with the run of {m.get('date', '?')} (celery-dedup "
        f"{m.get('celery_dedup', '?')}, n={m.get('iterations', '?')}); timings are only "
        "comparable on the same machine, ratios a little more",
        "",
    ]
    for key in ROWS:
        if key not in before:
            continue
        label, unit = LABELS[key]
        change = (after[key] / before[key] - 1) * 100 if before[key] else 0.0
        lines.append(f"{label:<38} {before[key]:>12,.1f} -> {after[key]:>12,.1f} {unit:<8} "
                     f"{change:+6.1f} %")
    lines.append("")
    earlier = {t["target"]: t for t in previous.get("targets", [])}
    for target in results["targets"]:
        old = earlier.get(target["target"])
        was = f"{old['value']:>9.2f}" if old else f"{'(new)':>9}"
        state = "met" if target["met"] else "MISSED"
        lines.append(f"{target['target']:<38} {was} -> {target['value']:>9.2f} "
                     f"{target['bound']:<8} {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table (and the comparison with the last run), write the JSON file.

    The previous results at ``--json`` are kept beside it as
    ``previous.json`` (``<name>.previous.json`` for another name).
    """
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="seconds, small N (CI)")
    parser.add_argument("--iterations", type=int, help="calls per round")
    parser.add_argument("--rounds", type=int, help="rounds; the best one counts")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole runs, each on fresh servers; rows are their median")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    parser.add_argument("--publish", action="store_true",
                        help=f"write the results to {PUBLISHED.relative_to(ROOT)} and the table "
                             f"into {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.runs > 1:
        results = combine(separate_runs(args.runs, args.smoke, args.iterations, args.rounds))
    else:
        results = run(smoke=args.smoke, iterations=args.iterations, rounds=args.rounds)
    table = format_table(results)
    print(table)
    target = PUBLISHED if args.publish else args.json
    comparison = save(results, target)
    if comparison is not None:
        print("\n" + comparison)
    if args.publish:
        publish_table(PAGE, table)
        print(f"\nthe table is in {PAGE.relative_to(ROOT)}")
    kept = previous_path(target)
    print(f"\nwritten to {target}" + (f" (the run before: {kept})" if kept.exists() else ""))
    return 0


def separate_runs(count: int, smoke: bool, iterations: int | None,
                  rounds: int | None) -> list[dict[str, Any]]:
    """``count`` whole runs, each in a process of its own (fresh servers, fresh clients)."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for number in range(1, count + 1):
            path = Path(folder) / f"run{number}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--json", str(path)]
            command += ["--smoke"] if smoke else []
            command += ["--iterations", str(iterations)] if iterations else []
            command += ["--rounds", str(rounds)] if rounds else []
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            results.append(json.loads(path.read_text()))
            print(f"run {number} of {count} done", flush=True)
    return results


def publish_table(page: Path, table: str) -> None:
    """Put ``table`` between ``TABLE_START`` and ``TABLE_END`` in ``page``."""
    text = page.read_text()
    head, found, rest = text.partition(TABLE_START)
    _, found_end, tail = rest.partition(TABLE_END)
    if not (found and found_end):
        raise SystemExit(f"{page}: the lines {TABLE_START!r} and {TABLE_END!r} are missing")
    page.write_text(f"{head}{TABLE_START}\n\n```text\n{table}\n```\n\n{TABLE_END}{tail}")


def previous_path(path: Path) -> Path:
    """Where the results a run replaces at ``path`` are kept."""
    return path.with_name("previous.json" if path.name == "latest.json"
                          else f"{path.stem}.previous.json")


def save(results: dict[str, Any], path: Path) -> str | None:
    """Write ``results`` to ``path``, keeping what was there (``previous_path``).

    Returns the comparison with those earlier results, if there were any.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    comparison = None
    if path.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            comparison = format_comparison(json.loads(path.read_text()), results)
        path.replace(previous_path(path))
    path.write_text(json.dumps(results, indent=2) + "\n")
    return comparison


if __name__ == "__main__":
    sys.exit(main())
