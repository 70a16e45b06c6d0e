"""``benchmarks/run.py --smoke`` produces every row and one store round trip per operation.

Timings are never asserted: CI machines are shared; only the counts are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import profile_calls
from benchmarks.run import ROUND_TRIPS, ROWS, format_table, main, previous_path, save


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    """The smoke run starts its own servers, fills every row and counts round trips on Redis."""
    target = tmp_path / "latest.json"
    assert main(["--smoke", "--json", str(target)]) == 0
    results = json.loads(target.read_text())
    assert results["meta"]["smoke"] is True
    assert set(results["rows"]) == set(ROWS)
    # A flag (1 yes, 0 no), not a measure: the order a smoke run's few handoffs keep is
    # timing (tests/core/test_slot_handoff.py proves the order); every other row is filled.
    flags = {"k_handoff_in_call_order"}
    rows = results["rows"]
    assert {row: value for row, value in rows.items() if row not in flags and not value > 0} == {}
    assert all(rows[row] in (0.0, 1.0) for row in flags)
    assert set(results["round_trips"]) == set(ROUND_TRIPS)
    trips = {name: results["round_trips"][name]["round_trips"] for name in ROUND_TRIPS}
    assert trips["acquire"] == 1
    assert trips["duplicate"] == 1
    assert trips["release"] == 1
    assert trips["executed"] <= 2
    # the rate window and the lock in one script (Redis)
    assert trips["acquire_rated"] == 1
    assert trips["duplicate_rated"] == 1
    for name in ("acquire", "duplicate", "release"):
        assert results["round_trips"][name]["commands"]["evalsha"] == 1
    # 1,000 items with 10% repeats through enqueue_many(per_item=True): one script
    assert trips["bulk_1000"] == 1
    assert results["round_trips"]["bulk_1000"]["commands"]["evalsha"] == 1
    assert results["rows"]["m_bulk_per_item_1000"] > 0  # the bulk rows ran
    assert len(results["targets"]) == 14
    assert results["rows"]["l_lease_pass_1000"] > 0  # the lease upkeep row ran
    earlier = json.loads(target.read_text())
    earlier["meta"]["date"] = "an earlier run"
    target.write_text(json.dumps(earlier))
    comparison = save(results, target)  # what the next run does with this one
    assert comparison is not None and "an earlier run" in comparison
    assert all(t["target"] in comparison for t in results["targets"])
    assert json.loads(previous_path(target).read_text())["meta"]["date"] == "an earlier run"
    table = format_table(results)
    assert "store round trips per executed" in table
    assert all(target["target"] in table for target in results["targets"])


def test_profile_script_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/profile_calls.py`` times and profiles both cases on its stubs (no server)."""
    for name in ("BENCH_BROKER", "BENCH_STORE", "BENCH_RESULTS"):
        monkeypatch.setenv(name, "")  # restored afterwards: the script sets its own
    assert profile_calls.main(["--calls", "50", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "== first enqueue:" in out and "== duplicate:" in out
    assert "celery_dedup/task.py" in out and "(apply_async)" in out
