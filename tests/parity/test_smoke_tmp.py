from __future__ import annotations

from .harness import Scenario, describe_difference, run

CALLS = ["delay", "apply_async", "s", "si", "send_task", "chain", "group", "chord", "nested"]

def test_one(redis_pair):
    scs = [Scenario(routes="dict", serializer="json", call=call, options=(("countdown", 0.1), ("headers", {"x-par": "v"}))) for call in CALLS]
    out = {}
    for side in (redis_pair.plain, redis_pair.dedup):
        with redis_pair.working(side):
            out[side.label] = [run(side, redis_pair.capture, sc, 1000 + i) for i, sc in enumerate(scs)]
    diffs = [f"{sc}\n{describe_difference(p, d)}" for sc, p, d in zip(scs, out["plain"], out["dedup"]) if p != d]
    assert not diffs, "\n\n".join(diffs)
