"""The benchmark module runs end to end and counts one store round trip per operation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.run import format_table, run
from tests.fixtures.redis import RedisServer


@pytest.mark.redis
def test_benchmark_round_trips_are_one(redis_server: RedisServer, redis_url: str) -> None:
    """A tiny benchmark run measures every section and exactly one round trip per store op."""
    results = run(broker_url="memory://", store_url=redis_url, iterations=20, rounds=1)
    trips = results["round_trips"]
    assert trips["acquire"]["round_trips"] == 1
    assert trips["duplicate"]["round_trips"] == 1
    assert trips["release"]["round_trips"] == 1
    for op in ("acquire", "duplicate", "release"):
        assert trips[op]["commands"]["evalsha"] == 1
    assert results["enqueue"]["ratio"] > 0
    assert results["rejection"]["dedup_duplicates_per_s"] > 0
    assert results["acquire_release"]["raw_set_nx_del_us"] > 0
    assert "store round trips per duplicate" in format_table(results)
    leftover = list(redis_server.client(1).scan_iter("celery-dedup:bench.dedup:*"))
    assert leftover == [], "the benchmark leaves no lock behind"


def test_benchmark_cli_writes_json(tmp_path: Path) -> None:
    """``benchmarks/run.py``'s ``main`` starts its own Redis and writes the JSON file."""
    from benchmarks.run import main

    target = tmp_path / "latest.json"
    assert main(["--iterations", "10", "--rounds", "1", "--json", str(target)]) == 0
    written = json.loads(target.read_text())
    assert written["meta"]["broker"] == "redis"
    assert written["round_trips"]["acquire"]["round_trips"] == 1
