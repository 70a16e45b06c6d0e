"""``benchmarks/run.py --smoke`` produces every row and one store round trip per operation.

Timings are never asserted: CI machines are shared; only the counts are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import profile_calls
from benchmarks.run import (
    PAGE,
    PUBLISHED,
    ROUND_TRIPS,
    ROWS,
    TABLE_END,
    TABLE_START,
    combine,
    format_table,
    main,
    previous_path,
    publish_table,
    save,
    targets,
)


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
    _combined_runs_are_medians(results, tmp_path)


def _combined_runs_are_medians(results: dict[str, Any], tmp_path: Path) -> None:
    """``--runs 3``: each row and target is the median of the runs, shown with its spread."""
    runs = []
    for scale in (1.0, 2.0, 4.0):  # three runs, every timing of the second twice the first's
        rows = {key: value * scale if key.startswith(("a_", "c_")) else value
                for key, value in results["rows"].items()}
        runs.append({**results, "rows": rows, "targets": targets(rows, results["round_trips"])})
    combined = combine(runs)
    plain = results["rows"]["a_plain_apply_async"]
    assert combined["rows"]["a_plain_apply_async"] == plain * 2
    assert combined["spread"]["a_plain_apply_async"] == [plain, plain * 4]
    assert combined["meta"]["runs"] == 3
    first = next(t for t in combined["targets"] if t["target"] == "first enqueue vs g (speed)")
    assert sorted(first["runs"]) == sorted(t["value"] for run in runs for t in run["targets"]
                                           if t["target"] == first["target"])
    assert first["value"] == sorted(first["runs"])[1]
    table = format_table(combined)
    assert "median of 3 runs" in table
    assert f"{plain:,.1f} to {plain * 4:,.1f}" in table
    page = tmp_path / "page.md"
    page.write_text(f"# Numbers\n\n{TABLE_START}\nold\n{TABLE_END}\n\nafter\n")
    publish_table(page, table)
    written = page.read_text()
    assert "old" not in written and table in written and written.endswith("after\n")


def test_the_published_table_is_the_published_runs() -> None:
    """docs/benchmarks.md shows exactly what ``--runs 5 --publish`` wrote beside it: five full
    runs' medians (not a smoke run, not a single run, not an edited table)."""
    published = json.loads(PUBLISHED.read_text())
    assert published["meta"]["smoke"] is False
    assert published["meta"]["runs"] >= 5
    assert set(published["rows"]) == set(ROWS) == set(published["spread"])
    page = PAGE.read_text()
    block = page.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert block == f"\n\n```text\n{format_table(published)}\n```\n\n"
    for target in published["targets"]:  # a miss says so
        line = next(line for line in block.splitlines() if line.startswith(target["target"]))
        assert ("MISSED" in line) is (not target["met"])


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
