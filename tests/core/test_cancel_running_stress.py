"""Randomized stress of ``cancel_running`` and of a capped ``replace`` (issue 24, items 2-3).

Several producer threads call a few keys at random moments while a
two-slot prefork worker runs them: some keys with ``cancel_running``,
others with ``on_duplicate="replace"``, a ``countdown`` and
``debounce_max_wait``. Bodies record their start and end (or the
``SoftTimeLimitExceeded`` interrupt) with timestamps in a Redis list
shared by every process. Once the producers are done, each key gets one
last call. Asserted from the records:

- ``cancel_running``: two bodies of one key never overlap, except the
  documented cleanup overlap (the earlier body was interrupted and was
  still cleaning up when the next one started);
- every published message reaches a final state (ran, or was cancelled or
  replaced: nothing is left pending), no message's body runs twice;
- the last call of each key runs exactly once, to its end, with its
  arguments.

``DEDUP_STRESS_SEED`` replays a run's draws. (The reliability soak draws
these policies too and its checker judges them among every other policy,
under faults; this test aims many more calls at a few keys.)
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from celery_dedup import CancelTimeout, DedupTask, inspect_lock
from tests.fixtures.redis import RedisServer

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import state_of, texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(300)

QUEUE = "cancel-stress"
BROKER_DB, BACKEND_DB, RUNS_DB = 46, 47, 48
#: keys 0-2 cancel the running call; 3-4 debounce with a cap
CANCEL_KEYS = (0, 1, 2)
DEBOUNCE_KEYS = (3, 4)
PRODUCERS, CALLS_PER_PRODUCER = 3, 10
#: states after which a message never runs again
FINAL = {"SUCCESS", "FAILURE", "REVOKED", "IGNORED"}

app = env_app("cancel_stress", "STRESS", QUEUE)
runs_log = RunsLog("STRESS")


def record(kind: str, doc: int, seq: str) -> None:
    """Append one timestamped event to the shared log."""
    event = {"kind": kind, "doc": doc, "seq": seq, "t": time.time()}
    runs_log.client().rpush("runs", json.dumps(event))


def _work(doc: int, seq: str, sleep: float) -> str:
    """Work for ``sleep`` seconds; an interrupt ends it early (recorded)."""
    try:
        record("start", doc, seq)
        deadline = time.monotonic() + sleep
        while time.monotonic() < deadline:
            time.sleep(0.02)
        record("end", doc, seq)
    except SoftTimeLimitExceeded:
        record("interrupted", doc, seq)
        return "interrupted"
    return seq


cancelling = app.task(
    name="stress.cancelling",
    base=DedupTask,
    unique_for=120,
    on_duplicate="cancel_running",
    unique_on=("doc",),
    cancel_wait=60,
)(_work)
debouncing = app.task(
    name="stress.debouncing",
    base=DedupTask,
    unique_for=120,
    on_duplicate="replace",
    unique_on=("doc",),
    debounce_max_wait=1.0,
)(_work)


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc=(
        "A two-slot prefork worker; locks in Redis (take-over of a queued holder in one "
        "step) or PostgreSQL (revoke, then acquire)."
    ),
)


def call(doc: int, seq: str, sleep: float) -> Any:
    """One call of ``doc``'s policy."""
    if doc in CANCEL_KEYS:
        return cancelling.delay(doc, seq, sleep)
    return debouncing.apply_async((doc, seq, sleep), countdown=0.3)


def events(redis_server: RedisServer) -> list[dict[str, Any]]:
    """Every event recorded so far, in order."""
    with redis_server.client(RUNS_DB) as client:
        return [json.loads(e) for e in texts(client.lrange("runs", 0, -1))]


def test_random_cancels_and_capped_replaces(worker: Worker, redis_server: RedisServer) -> None:
    """No overlap beyond the cleanup rule, nothing left pending, each last call runs once."""
    seed = int(os.environ.get("DEDUP_STRESS_SEED") or random.randrange(1 << 30))
    about = f"seed {seed}"
    worker.start()
    published: list[Any] = []
    timeouts: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def produce(index: int) -> None:
        rng = random.Random(seed * 10 + index)
        try:
            for i in range(CALLS_PER_PRODUCER):
                time.sleep(rng.uniform(0.0, 0.3))
                doc = rng.choice(CANCEL_KEYS + DEBOUNCE_KEYS)
                seq = f"p{index}-{i}"
                try:
                    result = call(doc, seq, round(rng.uniform(0.05, 1.0), 3))
                except CancelTimeout:
                    with lock:
                        timeouts.append(seq)  # nothing published: allowed, counted
                    continue
                with lock:
                    published.append(result)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(PRODUCERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, f"{about}: {errors!r}"
    last = {doc: call(doc, f"last-{doc}", 0.05) for doc in CANCEL_KEYS + DEBOUNCE_KEYS}
    for doc, result in last.items():
        assert result.deduplicated is False, about
        assert result.get(timeout=60) == f"last-{doc}", about

    # Nothing left pending: every published message reached a final state.
    for result in published:
        try:
            wait_until(lambda r=result: state_of(app, r.id) in FINAL, timeout=60)
        except AssertionError:
            log = "\n".join(
                line for line in worker.log.read_text().splitlines() if result.id in line
            )
            raise AssertionError(
                f"{about}: {result.id} ({result.deduplication_key}) stayed "
                f"{state_of(app, result.id)}; its worker log lines:\n{log}"
            ) from None
    for result in last.values():
        wait_until(lambda r=result: inspect_lock(r.deduplication_key, app=app) is None, 30)

    runs: dict[int, dict[str, dict[str, float]]] = defaultdict(dict)
    for event in events(redis_server):
        seen = runs[event["doc"]].setdefault(event["seq"], {})
        assert event["kind"] not in seen, f"{about}: {event['seq']} {event['kind']} twice"
        seen[event["kind"]] = event["t"]
    for doc, by_seq in runs.items():
        for seq, seen in by_seq.items():
            # (An interrupt may land before the body's first line.)
            assert "start" in seen or "interrupted" in seen, f"{about}: {seq} never started"
            assert "end" in seen or "interrupted" in seen, f"{about}: {seq} never finished"
        # The last call ran once, to its end (nothing cancelled it).
        assert set(by_seq[f"last-{doc}"]) == {"start", "end"}, f"{about}: {by_seq}"
        if doc not in CANCEL_KEYS:
            assert not any("interrupted" in seen for seen in by_seq.values()), about
            continue
        ordered = sorted(
            ((seq, seen) for seq, seen in by_seq.items() if "start" in seen),
            key=lambda item: item[1]["start"],
        )
        for i, (seq_a, a) in enumerate(ordered):
            finished = a.get("end", a.get("interrupted", float("inf")))
            for seq_b, b in ordered[i + 1 :]:
                if b["start"] < finished:
                    # The only overlap allowed: a cancelled body still cleaning up.
                    assert "interrupted" in a, f"{about}: {seq_a} and {seq_b} of {doc} overlap"
    assert timeouts == [], f"{about}: {timeouts}"
    cancelled = sum("interrupted" in s for r in runs.values() for s in r.values())
    # Not a vacuous pass: running bodies were interrupted.
    assert cancelled > 0, f"{about}: no running holder was cancelled; {dict(runs)}"
