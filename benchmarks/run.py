"""Benchmarks of celery-dedup against plain Celery and raw redis-py.

Run from the repository root (after ``pip install -e '.[dev]'``)::

    python benchmarks/run.py [--iterations 2000] [--rounds 3] [--json PATH]

It starts two throwaway redis-servers on free loopback ports (a broker and a
lock store, so the store's traffic can be counted on its own), measures, in
one run:

(a) enqueue overhead: ``DedupTask.apply_async`` taking a lock vs plain
    ``Task.apply_async`` (Redis broker, no worker, queue purged after each round);
(b) rejection throughput: duplicate calls per second vs raw redis-py
    ``SET NX PX`` calls per second on an already-held key, on the store server;
(c) ``RedisStore.acquire`` + ``release`` vs raw redis-py ``SET NX PX`` + ``DEL``;
(d) store round trips per acquire, per duplicate and per release, counted on
    the server (``INFO`` ``total_reads_processed`` and ``commandstats`` deltas),

prints a table and writes JSON to ``benchmarks/results/latest.json``. Times
are the best of ``--rounds`` rounds; what matters are the ratios, measured
side by side on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import celery
import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask, release
from celery_dedup.runtime import runtime_for

#: the queue every benchmark publishes to (purged, never consumed)
QUEUE = "celery-dedup-bench"
RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
LOCK_SECONDS = 600

# -- throwaway redis-server (tests/fixtures/_servers.py without pytest) ------

_EXTRA_PATHS = ["/usr/sbin", "/sbin"]


def free_port() -> int:
    """A TCP port nothing listens on right now, on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Wait until 127.0.0.1:port accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited early with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run a redis-server without persistence on a free port; yield its URL."""
    binary = shutil.which("redis-server") or shutil.which(
        "redis-server", path=os.pathsep.join(_EXTRA_PATHS)
    )
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian/Ubuntu: the redis-server package)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="celery-dedup-bench-") as directory:
        argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                "--appendonly", "no", "--dir", directory]
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_for_port(port, proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)


# -- what is measured ---------------------------------------------------------


def build_app(broker_url: str, store_url: str) -> tuple[Celery, Any, Any]:
    """An app with a plain task and a ``DedupTask`` that differ only in their base."""
    app = Celery("celery_dedup_bench", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        dedup_store=store_url,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=False,
        # Counters are flushed to the store every few seconds (one pipelined
        # round trip); keep that out of the per-call counts.
        dedup_metrics_flush_interval=3600,
    )

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(name="bench.dedup", base=DedupTask, shared=False, unique_for=LOCK_SECONDS)
    def dedup(n: int) -> int:
        return n

    return app, plain, dedup


def best_seconds_per_op(
    op: Callable[[int], object],
    iterations: int,
    rounds: int,
    after_round: Callable[[], object] | None = None,
) -> float:
    """Best (lowest) mean seconds per call of ``op(i)`` over ``rounds`` rounds.

    ``i`` is unique across every call, so keyed operations never collide.
    """
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
    return best


class ServerCounter:
    """Counts what one Redis server processed between two snapshots."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def snapshot(self) -> tuple[int, dict[str, int]]:
        """``(total_reads_processed, {command: calls})`` right now (one INFO)."""
        info = self.client.info("all")
        calls = {
            name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in info.items()
            if name.startswith("cmdstat_")
        }
        return int(info["total_reads_processed"]), calls

    def per_op(self, op: Callable[[int], object], count: int) -> dict[str, Any]:
        """Run ``op`` ``count`` times; return round trips and commands per call."""
        reads_before, calls_before = self.snapshot()
        for i in range(count):
            op(i)
        reads_after, calls_after = self.snapshot()
        # The second INFO is itself one read and one "info" call.
        round_trips = (reads_after - reads_before - 1) / count
        commands = {
            name: (calls - calls_before.get(name, 0)) / count
            for name, calls in sorted(calls_after.items())
            if name != "info" and calls != calls_before.get(name, 0)
        }
        return {"round_trips": round_trips, "commands": commands}


def run(
    broker_url: str, store_url: str, iterations: int = 2000, rounds: int = 3
) -> dict[str, Any]:
    """Run every benchmark; return the results (no printing).

    ``store_url`` must be a Redis database the benchmark may flush, on a
    server nothing else uses while it runs (the round-trip counts are
    server-wide). ``broker_url`` may be any broker (``memory://`` too).
    """
    app, plain, dedup = build_app(broker_url, store_url)
    raw = redis.Redis.from_url(store_url)
    raw.flushdb()
    store = runtime_for(app).store
    assert store is not None
    meta = {"task_name": "bench.store", "policy": "success"}
    ttl_ms = LOCK_SECONDS * 1000

    def purge() -> None:
        app.control.purge()
        raw.flushdb()

    try:
        # (a) enqueue overhead
        plain_s = best_seconds_per_op(lambda i: plain.apply_async((i,)), iterations, rounds, purge)
        dedup_s = best_seconds_per_op(lambda i: dedup.apply_async((i,)), iterations, rounds, purge)

        # (b) rejection throughput, on a key that stays held
        holder = dedup.apply_async((-1,))
        assert holder.deduplicated is False
        assert dedup.apply_async((-1,)).deduplicated is True
        duplicate_s = best_seconds_per_op(lambda i: dedup.apply_async((-1,)), iterations, rounds)
        raw.set("bench:raw:held", "holder", nx=True, px=ttl_ms)
        assert raw.set("bench:raw:held", "other", nx=True, px=ttl_ms) is None
        raw_reject_s = best_seconds_per_op(
            lambda i: raw.set("bench:raw:held", str(i), nx=True, px=ttl_ms), iterations, rounds
        )

        # (c) acquire + release
        def store_cycle(i: int) -> None:
            key = f"bench:store:{i}"
            store.acquire(key, "owner", LOCK_SECONDS, meta)
            store.release(key, "owner")

        def raw_cycle(i: int) -> None:
            key = f"bench:raw:{i}"
            raw.set(key, "owner", nx=True, px=ttl_ms)
            raw.delete(key)

        store_cycle_s = best_seconds_per_op(store_cycle, iterations, rounds)
        raw_cycle_s = best_seconds_per_op(raw_cycle, iterations, rounds)
        purge()

        # (d) round trips per operation, through the public paths
        counter = ServerCounter(store_url)
        count = min(iterations, 200)
        acquired: list[Any] = []
        acquire = counter.per_op(lambda i: acquired.append(dedup.apply_async((10**9 + i,))), count)
        assert all(result.deduplicated is False for result in acquired)
        duplicate = counter.per_op(lambda i: dedup.apply_async((10**9 + i,)), count)
        released = counter.per_op(lambda i: release(acquired[i], app=app), count)
        assert all(store.get(result.deduplication_key) is None for result in acquired)
        counter.client.close()
        purge()
    finally:
        # Write the pending counters while the store still runs (not at exit).
        runtime_for(app).metrics.flush()
        raw.close()
        app.close()

    return {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "iterations": iterations,
            "rounds": rounds,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "celery": celery.__version__,
            "kombu": version("kombu"),
            "redis_py": redis.__version__,
            "redis_server": redis.Redis.from_url(store_url).info("server")["redis_version"],
            "celery_dedup": celery_dedup.__version__,
            "broker": broker_url.partition("://")[0],
        },
        "enqueue": {
            "plain_apply_async_us": plain_s * 1e6,
            "dedup_apply_async_us": dedup_s * 1e6,
            "ratio": dedup_s / plain_s,
        },
        "rejection": {
            "dedup_duplicates_per_s": 1 / duplicate_s,
            "raw_set_nx_px_per_s": 1 / raw_reject_s,
            "ratio": raw_reject_s / duplicate_s,
        },
        "acquire_release": {
            "store_acquire_release_us": store_cycle_s * 1e6,
            "raw_set_nx_del_us": raw_cycle_s * 1e6,
            "ratio": store_cycle_s / raw_cycle_s,
        },
        "round_trips": {"acquire": acquire, "duplicate": duplicate, "release": released},
    }


def format_table(results: dict[str, Any]) -> str:
    """The results as a plain-text table."""
    e, r, c, t = (results[k] for k in ("enqueue", "rejection", "acquire_release", "round_trips"))
    m = results["meta"]
    rows = [
        ("(a) enqueue: plain Task.apply_async", f"{e['plain_apply_async_us']:.1f} µs/call", ""),
        ("    DedupTask.apply_async (new lock)", f"{e['dedup_apply_async_us']:.1f} µs/call",
         f"x{e['ratio']:.2f}"),
        ("(b) reject: raw SET NX PX (held key)", f"{r['raw_set_nx_px_per_s']:,.0f} /s", ""),
        ("    DedupTask duplicate call", f"{r['dedup_duplicates_per_s']:,.0f} /s",
         f"x{r['ratio']:.2f}"),
        ("(c) raw SET NX PX + DEL", f"{c['raw_set_nx_del_us']:.1f} µs", ""),
        ("    RedisStore acquire + release", f"{c['store_acquire_release_us']:.1f} µs",
         f"x{c['ratio']:.2f}"),
    ]
    for name in ("acquire", "duplicate", "release"):
        cmds = ", ".join(f"{k} {v:g}" for k, v in t[name]["commands"].items())
        rows.append((f"(d) store round trips per {name}", f"{t[name]['round_trips']:g}", cmds))
    width = max(len(row[0]) for row in rows)
    lines = [
        f"celery-dedup {m['celery_dedup']} · celery {m['celery']} · redis-server "
        f"{m['redis_server']} · Python {m['python']} · {m['iterations']} iterations, "
        f"best of {m['rounds']}",
        "",
    ]
    lines += [f"{a:<{width}}  {b:>16}  {c_}" for a, b, c_ in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Start the servers, run, print the table and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best one counts")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(argv)
    with redis_server() as broker_url, redis_server() as store_url:
        results = run(broker_url, store_url, args.iterations, args.rounds)
    print(format_table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
