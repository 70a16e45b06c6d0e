"""Profile celery-dedup's own Python on the producer path, without any round trip.

Run from the repository root::

    python benchmarks/profile_calls.py               # 20 000 first enqueues, 20 000 duplicates
    python benchmarks/profile_calls.py --calls 5000 --top 15

The benchmark app's tasks (``benchmarks/app.py``) run on an in-process
``memory://`` lock store, and the broker's publish is a stub (Celery builds
the message, nothing sends it): what is left is Celery's own ``apply_async``
and celery-dedup's Python. Each case is timed without the profiler first
(µs per call, beside a plain task's ``apply_async`` through the same stub),
then profiled with cProfile; the table lists the functions with the most
cumulative time, celery-dedup's own first.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))


def load_app() -> Any:
    """``benchmarks.app`` on a memory broker and a memory lock store, its publish stubbed."""
    os.environ.update(BENCH_BROKER="memory://", BENCH_STORE="memory://profile", BENCH_RESULTS="")
    module = sys.modules.get("benchmarks.app")  # configured for other servers: configure again
    bench = importlib.reload(module) if module else importlib.import_module("benchmarks.app")

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> None:
        """The stub publish: the message is built, nothing is sent."""

    bench.app.amqp.send_task_message = send_task_message
    return bench


def us_per_call(op: Callable[[int], object], calls: int, start: int) -> float:
    """Mean µs per ``op(i)`` over ``calls`` calls (best of three)."""
    best = float("inf")
    for round_ in range(3):
        base = start + round_ * calls
        began = time.perf_counter()
        for i in range(base, base + calls):
            op(i)
        best = min(best, (time.perf_counter() - began) / calls)
    return best * 1e6


def profile(op: Callable[[int], object], calls: int, start: int) -> pstats.Stats:
    """cProfile of ``calls`` calls of ``op``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(start, start + calls):
        op(i)
    profiler.disable()
    return pstats.Stats(profiler)


def top_entries(stats: pstats.Stats, calls: int, top: int, own: bool) -> list[str]:
    """The ``top`` functions by cumulative time, as lines (µs per call of the profiled op)."""
    entries = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        mine = f"{os.sep}celery_dedup{os.sep}" in path
        if own and not mine:
            continue
        where = path.split(f"site-packages{os.sep}")[-1].split(f"{ROOT}{os.sep}")[-1]
        entries.append((cumtime, tottime, ncalls, f"{where}:{line}({name})"))
    entries.sort(reverse=True)
    return [
        f"{cum / calls * 1e6:8.2f} {tot / calls * 1e6:8.2f} {n / calls:7.2f}  {label}"
        for cum, tot, n, label in entries[:top]
    ]


def main(argv: list[str] | None = None) -> int:
    """Time and profile the first enqueue and the duplicate; print the top entries."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per profiled case")
    parser.add_argument("--top", type=int, default=25, help="entries listed per case")
    parser.add_argument("--all", action="store_true", help="list every library, not only ours")
    args = parser.parse_args(argv)
    bench = load_app()
    plain, dedup, calls = bench.plain, bench.dedup, args.calls
    dedup.apply_async((-1,))  # the held key every duplicate hits; warms the caches
    for i in range(200):
        plain.apply_async((i,))
        dedup.apply_async((-1000 - i,))
    cases: dict[str, Callable[[int], object]] = {
        "first enqueue": lambda i: dedup.apply_async((i,)),
        "duplicate": lambda i: dedup.apply_async((-1,)),
    }
    plain_us = us_per_call(lambda i: plain.apply_async((i,)), calls, 0)
    print(f"plain apply_async (stub publish): {plain_us:.2f} µs per call")
    start = 10**7
    for name, op in cases.items():
        timed = us_per_call(op, calls, start)
        start += 10 * calls
        stats = profile(op, calls, start)
        start += 10 * calls
        print(f"\n== {name}: {timed:.2f} µs per call ({timed - plain_us:+.2f} µs vs plain) ==")
        print("  cum µs   own µs   calls  function (per call of apply_async, under cProfile)")
        for line in top_entries(stats, calls, args.top, own=not args.all):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
