"""What producer processes call, and when: the soak's mixed workload and the race.

The soak:

Every key has a fixed profile (its ``unique_until``, a short or long
``unique_for``, ``deterministic_id`` or not; every seventh key is coalesced
with ``on_duplicate="keep_last"``, and of another seventh half the keys
cancel the running call with ``on_duplicate="cancel_running"`` and half
debounce with a cap: ``on_duplicate="replace"``, a ``countdown`` on every
call and ``debounce_max_wait``); every other key's call draws its own
``on_duplicate``, ``countdown``/``expires``, a failure cooldown
(``retry_window``, under ``"success"`` and ``"expiry"``), half of them a
``concurrency_limit`` of 1 to 3 for their key (read by ``rel.work``'s
callable limit where the run enables it) and what its body
will do (sleep, fail, retry with a countdown), and some published calls are revoked shortly
after. Every eleventh key without a fixed policy only observes
(``dedup_mode="observe"``): its refused calls are published anyway, and each
must run. One step in sixteen makes 2 to 6 calls at once through
``enqueue_many(per_item=True)`` (the bulk call path), some repeating a key of
the same call. ``cancel_running`` bodies sleep longer, so calls find them running
and terminate them. Every call is named (``seq``) in its plan, so the
checker knows whose arguments each run carried. Producers pace their calls
to a fixed total rate.

CI runs the short form; ``DEDUP_SOAK_FULL=1`` runs the full one (10 000 calls
over 500 keys at ~100 calls/s); ``DEDUP_SOAK_SEED`` replays a run.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from celery_dedup import CancelTimeout, DuplicateTaskError
from celery_dedup.runtime import runtime_for

from .apps import make_app, work_task
from .probe import Producer, Recorder

__all__ = ["SoakPlan", "Workload", "bulk", "produce", "race"]

UNTILS = ("start", "success", "finish", "expiry")

#: ``cancel_running`` keys: never ``"start"`` (its runs hold no lock, so a
#: new call runs beside them as documented: nothing to cancel)
CANCEL_UNTILS = ("success", "finish", "expiry")
#: a capped debounce's ``debounce_max_wait``, and its calls' countdowns
MAX_WAIT = 0.6
DEBOUNCE_COUNTDOWN = (0.3, 1.5)
#: the share of steps that are bulk calls (``enqueue_many(per_item=True)``)
BULK_SHARE = 1 / 16


@dataclass(frozen=True)
class SoakPlan:
    """How big a soak run is."""

    calls: int
    keys: int
    producers: int
    #: calls per second, all producers together
    rate: float
    seed: int
    #: the longest countdown drawn (longer than the broker's visibility
    #: timeout in the redelivery fault: every waiting copy is redelivered)
    max_countdown: float = 1.5

    @classmethod
    def from_env(cls) -> SoakPlan:
        """The CI form, or the full one with ``DEDUP_SOAK_FULL=1``."""
        seed = int(os.environ.get("DEDUP_SOAK_SEED") or random.randrange(1 << 30))
        if os.environ.get("DEDUP_SOAK_FULL") == "1":
            return cls(calls=10_000, keys=500, producers=4, rate=100.0, seed=seed)
        return cls(calls=1_000, keys=50, producers=2, rate=50.0, seed=seed)


@dataclass
class Workload:
    """Draws the calls of one producer."""

    rng: random.Random
    keys: int
    max_countdown: float = 1.5

    @staticmethod
    def policy(n: int) -> str | None:
        """The ``on_duplicate`` fixed for key ``n`` (``capped``: replace with a cap), if any."""
        if n % 7 == 3:
            # keep_last is a key's policy (one run at a time is per key).
            return "keep_last"
        if n % 7 == 5:
            return "cancel_running" if (n // 7) % 2 == 0 else "capped"
        return None

    @classmethod
    def observes(cls, n: int) -> bool:
        """Whether key ``n``'s calls only observe (``dedup_mode="observe"``): every
        eleventh key among those without a fixed policy."""
        return n % 11 == 2 and cls.policy(n) is None

    @classmethod
    def profile(cls, n: int) -> dict[str, Any]:
        """The options fixed per key."""
        options: dict[str, Any] = {
            "unique_until": UNTILS[n % 4],
            "unique_for": 8.0 if n % 3 == 0 else (0.8, 1.5)[n % 2],
            "deterministic_id": n % 5 == 0,
        }
        if cls.observes(n):
            # A rollout's first step: every refusal is published anyway (dedup_mode).
            options["dedup_mode"] = "observe"
        if cls.policy(n) == "cancel_running":
            # A TTL longer than any run: only a cancel ends a running holder's lock.
            options.update(
                unique_until=CANCEL_UNTILS[(n // 7) % 3], unique_for=8.0, cancel_wait=5.0
            )
        return options

    def bulk_size(self) -> int:
        """How many calls the next step makes: 1 (``apply_async``), or 2 to 6 at once
        through ``enqueue_many(per_item=True)`` (one step in sixteen)."""
        return self.rng.randint(2, 6) if self.rng.random() < BULK_SHARE else 1

    def next_call(
        self, n: int | None = None
    ) -> tuple[int, dict[str, Any], dict[str, Any], float | None]:
        """``(n, plan, options, revoke_after)`` of the next call (of key ``n`` when given)."""
        rng = self.rng
        n = rng.randrange(self.keys) if n is None else n
        options = self.profile(n)
        pick = rng.random()
        on_duplicate = "existing" if pick < 0.7 else "raise" if pick < 0.85 else "replace"
        policy = self.policy(n)
        options["on_duplicate"] = on_duplicate if policy is None else policy
        pick = rng.random()
        if policy == "capped":
            options.update(
                on_duplicate="replace",
                debounce_max_wait=MAX_WAIT,
                countdown=round(rng.uniform(*DEBOUNCE_COUNTDOWN), 3),
            )
        elif pick < 0.10:
            options["countdown"] = round(rng.uniform(0.2, self.max_countdown), 3)
        elif pick < 0.13:
            options["expires"] = -1.0
        elif pick < 0.16:
            options.update(countdown=1.0, expires=0.3)
        if options["unique_until"] in ("success", "expiry") and rng.random() < 0.3:
            # A failure's cooldown, shorter than the window (retry_window).
            options["retry_window"] = round(options["unique_for"] * rng.choice((0.2, 0.5)), 3)
        plan: dict[str, Any] = {"sleep": round(rng.uniform(0.0, 0.1), 3)}
        if policy == "cancel_running":
            plan["sleep"] = round(rng.uniform(0.1, 0.5), 3)
        pick = rng.random()
        if pick < 0.08:
            plan["fail"] = True
        elif pick < 0.16:
            plan.update(retries=rng.randint(1, 2), retry_countdown=round(rng.uniform(0.1, 0.6), 3))
        revoke_after = round(rng.uniform(0.0, 0.4), 3) if rng.random() < 0.05 else None
        if policy != "cancel_running" and rng.random() < 0.5:
            # The key's concurrency_limit for this call (a callable of the call,
            # when the run sets ``apps.SLOTS``): it changes between a key's calls.
            # Not under cancel_running: a terminated body's slot lapses with its lease.
            plan["slots"] = rng.choice((1, 2, 3))
        return n, plan, options, revoke_after


def produce(
    index: int, plan: SoakPlan, conf: dict[str, Any], recorder_url: str, start_at: float
) -> None:
    """One producer process: its share of the calls at its share of the rate, then revokes."""
    app = make_app(conf, recorder_url, name=f"p{index}")
    task = work_task(app)
    recorder = Recorder(recorder_url)
    producer = Producer(recorder)
    workload = Workload(random.Random(plan.seed * 100 + index), plan.keys, plan.max_countdown)
    interval = plan.producers / plan.rate
    revokes: list[tuple[float, Any]] = []

    def revoke_due(until: float) -> None:
        while revokes and revokes[0][0] <= until:
            producer.revoke(revokes.pop(0)[1])

    for i in range(plan.calls // plan.producers):
        due = start_at + i * interval
        revoke_due(due)
        time.sleep(max(0.0, due - time.time()))
        size = workload.bulk_size()
        if size > 1:
            bulk(workload, producer, task, size, f"{index}-{i}", revokes)
            continue
        n, body, options, revoke_after = workload.next_call()
        body["seq"] = seq = f"{index}-{i}"
        try:
            result = producer.call(task, (n, body), seq=seq, **options)
        except (DuplicateTaskError, CancelTimeout):
            continue
        if revoke_after is not None and not result.deduplicated:
            revokes.append((time.time() + revoke_after, result))
            revokes.sort(key=lambda item: item[0])
    revoke_due(float("inf"))
    runtime_for(app).metrics.flush()
    recorder.close()
    app.close()


def bulk(
    workload: Workload,
    producer: Producer,
    task: Any,
    size: int,
    seq: str,
    revokes: list[tuple[float, Any]],
) -> None:
    """One ``enqueue_many(per_item=True)`` of ``size`` calls; a third of the later ones
    repeat an earlier call's key (an in-call duplicate)."""
    drawn: list[tuple[int, dict[str, Any], dict[str, Any], float | None]] = []
    for j in range(size):
        again = drawn and workload.rng.random() < 1 / 3
        drawn.append(workload.next_call(workload.rng.choice(drawn)[0] if again else None))
        drawn[-1][1]["seq"] = f"{seq}-b{j}"
    outcomes = producer.call_many(
        task, [((n, body), body["seq"], options) for n, body, options, _ in drawn]
    )
    for (_, _, _, revoke_after), outcome in zip(drawn, outcomes, strict=True):
        if revoke_after is not None and outcome.status.value == "published":
            revokes.append((time.time() + revoke_after, outcome.result))
    revokes.sort(key=lambda item: item[0])


def race(
    index: int, keys: int, conf: dict[str, Any], recorder_url: str, seed: int, start_at: float
) -> None:
    """One racing producer: every key once, in its own order, all starting at ``start_at``.

    ``unique_until="expiry"`` with a TTL longer than the run: one lock
    lifetime per key, so exactly one call per key may publish.
    """
    app = make_app(conf, recorder_url)
    task = work_task(app)
    recorder = Recorder(recorder_url)
    producer = Producer(recorder)
    order = list(range(keys))
    random.Random(seed * 100 + index).shuffle(order)
    time.sleep(max(0.0, start_at - time.time()))
    for n in order:
        producer.call(task, (n, {}), unique_until="expiry", unique_for=300)
    runtime_for(app).metrics.flush()
    recorder.close()
    app.close()


#: ``celery_dedup`` headers no producer of ours writes: each must be logged,
#: then handled as a message without a header (its guard runs it once).
MALFORMED_HEADERS: tuple[Any, ...] = (
    {"v": 1, "key": "k", "until": "bogus", "for": 10},
    {"v": 2, "key": "k", "until": "success", "for": 10},
    {"v": 1, "key": 12, "until": "success", "for": 10},
    {"v": 1, "key": "k", "until": "success", "for": "ten"},
    {"v": 1, "key": "k", "until": "success", "for": -1},
    {"v": 1, "key": "k", "until": "success", "for": 10, "replace": "yes"},
    {"v": 1, "key": "k" * 100_000, "until": "success", "for": 10},
    {"v": 1, "key": "k", "until": "success", "for": 10, "tok": ["a"]},
    "bogus",
    [1, 2, 3],
)


def send_malformed(
    plan: SoakPlan, conf: dict[str, Any], recorder_url: str, start_at: float, count: int
) -> None:
    """Send ``count`` messages with malformed headers among the soak's calls, each to a key
    of its own (``n`` past the workload's keys); their ids are marked ``malformed``.
    """
    app = make_app(conf, recorder_url)
    recorder = Recorder(recorder_url)
    rng = random.Random(plan.seed * 100 + 99)
    interval = plan.calls / plan.rate / max(count, 1)
    for i in range(count):
        time.sleep(max(0.0, start_at + i * interval - time.time()))
        header = MALFORMED_HEADERS[i % len(MALFORMED_HEADERS)]
        n = plan.keys + 1_000 + i
        sent = app.send_task(
            "rel.work", args=(n, {"sleep": round(rng.uniform(0.0, 0.1), 3)}),
            headers={"celery_dedup": header},
        )
        recorder.mark("malformed", {"task_id": sent.id, "n": n})
    recorder.close()
    app.close()
