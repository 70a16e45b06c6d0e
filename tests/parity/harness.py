"""Two sides of one scenario: a plain ``Task`` app and a ``DedupTask`` app, side by side.

Both apps define the same task names with the same bodies; only the base
class differs. Each app has its own queue and exchange names (a prefix
per side, so both can share one broker) and its own result database; the
prefix is normalised away before comparing.

What is compared:

- **messages**: every task message as kombu hands it to the channel
  (``Producer._publish``, wrapped to observe, never to change): decoded
  body, headers (``celery_dedup`` and ``dedup_called`` excluded), properties, content type and
  encoding, exchange, routing key, declared queues, publish retry policy;
- **executions**: what each body saw (task, arguments, retries, delivery
  exchange and routing key), recorded in a Redis list;
- **outcome**: the error raised by the call, or the states and results of
  the whole result tree (chain parents, group members, chord body).

Task ids, group ids and other uuids are replaced by ``<uuid>``; ``eta``,
``expires`` and ``expiration`` become offsets from the publish time compared
within a second.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import redis
from celery import Celery, Task, chain, chord, group
from celery.result import AsyncResult, GroupResult
from kombu import Exchange, Queue
from kombu.compression import decompress
from kombu.messaging import Producer
from kombu.serialization import loads

from celery_dedup import DedupTask
from celery_dedup.handoff import CALLED_FIELD

SERIALIZERS = ("json", "pickle", "msgpack", "yaml")
ROUTES = ("none", "dict", "glob", "function", "queue_objects", "exchange_rk")
PREFIXES = {"plain": "parP-", "dedup": "parD-"}
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TIMES = ("eta", "expires")


class Runs:
    """Executions recorded by the bodies of one side, in a Redis list."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.name = name

    def record(self, value: Any) -> None:
        """Append ``value`` as JSON."""
        self.client.rpush(self.name, json.dumps(value))

    def all(self) -> list[Any]:
        """Every recorded value, in order."""
        return [json.loads(raw) for raw in self.client.lrange(self.name, 0, -1)]

    def clear(self) -> None:
        """Forget everything recorded."""
        self.client.delete(self.name)


class Approx:
    """A time offset in seconds, equal to another within one second (clock skew of two runs)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Approx) and abs(self.seconds - other.seconds) < 1.0

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<time {self.seconds:.1f}>"


@dataclass
class Published:
    """One task message as it reached the channel."""

    at: float
    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    exchange: str
    routing_key: str
    declare: list[str]
    priority: Any
    retry_policy: Any


class Capture:
    """Record every task message this process publishes while active."""

    def __init__(self) -> None:
        self.messages: list[Published] = []
        self.lock = threading.Lock()

    @contextmanager
    def active(self) -> Iterator[Capture]:
        original = Producer._publish
        capture = self

        parameters = inspect.signature(original)

        def observed(producer: Any, *args: Any, **kwargs: Any) -> Any:
            given = parameters.bind(producer, *args, **kwargs).arguments
            at = time.time()
            # kombu's publish retry calls ``_publish`` again after a connection
            # error: only an attempt that returned reached the broker.
            sent = original(producer, *args, **kwargs)
            headers = given.get("headers")
            if isinstance(headers, Mapping) and "task" in headers:
                exchange, declare = given.get("exchange"), given.get("declare")
                with capture.lock:
                    capture.messages.append(Published(
                        at=at,
                        body=given["body"],
                        content_type=given["content_type"],
                        content_encoding=given["content_encoding"],
                        headers=dict(headers),
                        properties=dict(given.get("properties") or {}),
                        exchange=str(getattr(exchange, "name", exchange) or ""),
                        routing_key=str(given.get("routing_key") or ""),
                        declare=sorted(str(getattr(q, "name", q)) for q in declare or ()),
                        priority=given.get("priority"),
                        retry_policy=given.get("retry_policy"),
                    ))
            return sent

        with mock.patch.object(Producer, "_publish", observed):
            yield self

    def take(self) -> list[Published]:
        with self.lock:
            taken, self.messages = self.messages, []
        return taken


def normalise(value: Any, prefix: str) -> Any:
    """``value`` with uuids and the side's prefix replaced (recursively)."""
    if isinstance(value, str):
        return _UUID.sub("<uuid>", value.replace(prefix, "PF-"))
    if isinstance(value, bytes):
        return normalise(value.decode("utf-8", "replace"), prefix)
    if isinstance(value, Mapping):
        return {normalise(k, prefix): normalise(v, prefix) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalise(v, prefix) for v in value]
    if isinstance(value, datetime):
        return "<datetime>"
    if isinstance(value, BaseException):
        return f"{type(value).__name__}({normalise(str(value), prefix)})"
    return value


def _offset(raw: Any, at: float) -> Any:
    if raw is None:
        return None
    if isinstance(raw, (int, float)):
        return Approx(float(raw))
    moment = datetime.fromisoformat(str(raw))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return Approx(moment.timestamp() - at)


def _decode(body: bytes, compression: str | None, message: Published) -> Any:
    """The body as the worker would load it; a body that does not load is kept raw.

    (A retried message keeps its first publish's ``compression`` header while
    its body may not be compressed again: both sides then carry the same bytes.)
    """
    for compressed in (compression, None) if compression else (None,):
        try:
            raw = decompress(body, compressed) if compressed else body
            return loads(raw, message.content_type, message.content_encoding,
                         accept=[message.content_type])
        except Exception:
            continue
    return ["<undecodable>", body]


def describe_message(message: Published, prefix: str) -> dict[str, Any]:
    """A message with everything that varies between two runs normalised."""
    body = message.body
    headers = dict(message.headers)
    headers.pop("celery_dedup", None)
    headers.pop(CALLED_FIELD, None)  # its call time: a concurrency waiter's place in line
    decoded = _decode(body, headers.get("compression"), message)
    times = {name: _offset(headers.pop(name, None), message.at) for name in _TIMES}
    properties = dict(message.properties)
    expiration = properties.pop("expiration", None)
    described = normalise(
        {
            "body": decoded,
            "headers": headers,
            "properties": properties,
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "exchange": message.exchange,
            "routing_key": message.routing_key,
            "declare": message.declare,
            "priority": message.priority,
            "retry_policy": message.retry_policy,
        },
        prefix,
    )
    described.update(times)
    # kombu sends the expiration in milliseconds
    described["expiration"] = None if expiration is None else Approx(float(expiration) / 1000)
    return described


def sort_key(described: Mapping[str, Any]) -> str:
    return repr(sorted((k, v) for k, v in described.items() if not isinstance(v, Approx)))


@dataclass
class Side:
    """One app of a pair: its tasks, its executions and its names."""

    label: str
    app: Celery
    runs: Runs
    prefix: str
    tasks: dict[str, Any] = field(default_factory=dict)
    worker: Any = None

    @property
    def queues(self) -> list[str]:
        return [self.prefix + name for name in ("celery", "q1", "q2", "qx")]

    def set_routes(self, form: str) -> None:
        """Configure ``task_routes`` in ``form`` and make every cache see it."""
        pf = self.prefix
        names = [t.name for t in self.tasks.values()]

        def by_argument(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                        **_: Any) -> Any:
            if name.startswith("par.") and args and isinstance(args[0], int):
                return {"queue": pf + ("q1" if args[0] % 2 else "q2")}
            return None

        def as_queue(name: str, *_: Any, **__: Any) -> Any:
            if name.startswith("par.work"):
                return {"queue": Queue(pf + "q2", Exchange(pf + "q2"), routing_key=pf + "q2")}
            return None

        def exchange_only(name: str, *_: Any, **__: Any) -> Any:
            if name.startswith("par."):
                return {"exchange": pf + "ex", "routing_key": pf + "rk"}
            return None

        routes: Any = {
            "none": None,
            "dict": {name: {"queue": pf + "q1"} for name in names},
            "glob": {"par.work_*": {"queue": pf + "q2"}, "par.*": pf + "q1"},
            "function": (by_argument,),
            "queue_objects": (as_queue,),
            "exchange_rk": (exchange_only,),
        }[form]
        self.app.conf.task_routes = routes
        self.app.amqp.flush_routes()
        self.app.amqp.__dict__.pop("router", None)
        for task in self.tasks.values():
            if hasattr(task, "dedup_config"):
                task._dedup_config = None  # its routed flag follows task_routes


def build_side(label: str, broker_url: str, backend_url: str, runs: Runs,
               **conf: Any) -> Side:
    """An app whose ``par.*`` tasks are plain (``label="plain"``) or ``DedupTask``s."""
    prefix = PREFIXES[label]
    app = Celery(f"parity-{label}", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=backend_url,
        task_default_queue=prefix + "celery",
        task_queues=[
            Queue(prefix + "celery"),
            Queue(prefix + "q1"),
            Queue(prefix + "q2"),
            Queue(prefix + "qx", Exchange(prefix + "ex"), routing_key=prefix + "rk"),
        ],
        accept_content=list(SERIALIZERS),
        result_accept_content=["json"],
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        result_expires=None,
        dedup_default_ttl=120,
        **conf,
    )
    side = Side(label, app, runs, prefix)
    base: type[Task[Any, Any]] = DedupTask if label == "dedup" else Task
    define_tasks(side, base)
    return side


def _where(request: Any) -> list[Any]:
    info = request.delivery_info or {}
    return [info.get("exchange"), info.get("routing_key")]


def define_tasks(side: Side, base: type[Task[Any, Any]]) -> None:
    """The same bodies on both sides: each records what it saw, then returns."""
    app, runs, tasks = side.app, side.runs, side.tasks

    @app.task(base=base, shared=False, bind=True, name="par.done")
    def done(self: Any, value: int, nonce: int, step: int) -> int:
        runs.record(["done", value, step, self.request.retries, _where(self.request)])
        return value + 100

    @app.task(base=base, shared=False, bind=True, name="par.total")
    def total(self: Any, values: list[int], nonce: int) -> int:
        runs.record(["total", sorted(values), _where(self.request)])
        return sum(values)

    @app.task(base=base, shared=False, bind=True, name="par.record")
    def record(self: Any, value: Any, nonce: int) -> Any:
        runs.record(["record", value, _where(self.request)])
        return value

    @app.task(base=base, shared=False, bind=True, name="par.errback")
    def errback(self: Any, task_id: str) -> str:
        runs.record(["errback", _where(self.request)])
        return "handled"

    tasks.update(done=done, total=total, record=record, errback=errback)

    def work_task(serializer: str) -> Any:
        @app.task(base=base, shared=False, bind=True, name=f"par.work_{serializer}",
                  serializer=serializer)
        def work(self: Any, value: int, nonce: int, step: int, retries: int = 0,
                 replace: bool = False, fail: bool = False) -> int:
            request = self.request
            runs.record(["work", serializer, value, step, request.retries, _where(request),
                         (request.headers or {}).get("x-par")])
            if request.retries < retries:
                raise self.retry(countdown=0.3, max_retries=retries)
            if replace:
                raise self.replace(done.s(value, nonce, step))
            if fail:
                raise ValueError(f"failed at step {step}")
            return value + 1

        return work

    for serializer in SERIALIZERS:
        tasks[f"work_{serializer}"] = work_task(serializer)


@dataclass(frozen=True)
class Scenario:
    """One generated call: what is called, how, with which options, under which routes."""

    routes: str
    serializer: str
    call: str
    options: tuple[tuple[str, Any], ...]
    retries: int = 0
    replace: bool = False
    fail: bool = False
    members: int = 2


def concrete_options(side: Side, scenario: Scenario, nonce: int) -> dict[str, Any]:
    """The scenario's options for ``side``: its queue names, times from now, its callbacks."""
    pf, now = side.prefix, datetime.now(timezone.utc)
    options: dict[str, Any] = {}
    for name, value in scenario.options:
        if name == "queue":
            options["queue"] = pf + value
        elif name == "exchange_rk":
            options["exchange"], options["routing_key"] = pf + "ex", pf + "rk"
        elif name == "eta":
            options["eta"] = now + timedelta(seconds=value)
        elif name == "expires_at":
            options["expires"] = now + timedelta(seconds=value)
        elif name == "link":
            options["link"] = side.tasks["record"].s(nonce=nonce)
        elif name == "link_error":
            options["link_error"] = side.tasks["errback"].s()
        else:
            options[name] = value
    return options


def call(side: Side, scenario: Scenario, nonce: int) -> Any:
    """Make the scenario's call on ``side``; return its result handle."""
    work = side.tasks[f"work_{scenario.serializer}"]
    total = side.tasks["total"]
    extra = {"retries": scenario.retries, "replace": scenario.replace, "fail": scenario.fail}
    options = concrete_options(side, scenario, nonce)
    first = work.s(1, nonce, 0, **extra)
    kind = scenario.call
    if kind == "delay":
        return work.delay(1, nonce, 0, **extra)
    if kind == "apply_async":
        return work.apply_async((1, nonce, 0), extra, **options)
    if kind == "s":
        return first.apply_async(**options)
    if kind == "si":
        return work.si(1, nonce, 0, **extra).set(**options).delay()
    if kind == "send_task":
        return side.app.send_task(work.name, (1, nonce, 0), extra, **options)
    members = [work.s(i + 2, nonce, i + 1) for i in range(scenario.members)]
    if kind == "chain":
        return chain(first, work.s(nonce=nonce, step=10), work.s(nonce=nonce, step=11)).apply_async(
            **options)
    if kind == "group":
        return group([first, *members]).apply_async(**options)
    if kind == "chord":
        return chord([first, *members], total.s(nonce=nonce)).apply_async(**options)
    if kind == "nested":
        return chain(first, group(members), total.s(nonce=nonce),
                     work.s(nonce=nonce, step=20)).apply_async(**options)
    raise AssertionError(kind)


def _nodes(result: Any) -> list[Any]:
    """Every result of a result tree: a chain's parents, a group's members."""
    found: list[Any] = []
    seen: set[int] = set()
    pending = [result]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        if isinstance(node, GroupResult):
            pending.extend(node.results)
        pending.append(getattr(node, "parent", None))
    return found


def settle(side: Side, result: Any, messages: Callable[[], int], timeout: float) -> bool:
    """Wait until every published message ran and the result tree is ready or ignored.

    Returns whether that happened before ``timeout``.
    """
    deadline = time.monotonic() + timeout
    stable_since: float | None = None
    last: tuple[int, int] | None = None
    while time.monotonic() < deadline:
        counts = (len(side.runs.all()), messages())
        ready = all(
            n.ready() for n in _nodes(result) if isinstance(n, AsyncResult) and not n.ignored
        ) if result is not None else True
        if counts[0] >= counts[1] and ready:
            if counts == last and stable_since is not None:
                # Longer than the scenarios' 0.3 s retry delay: a retry still
                # to come must not land in the next scenario's capture.
                if time.monotonic() - stable_since > 0.8:
                    return True
            else:
                stable_since = time.monotonic()
        last = counts
        time.sleep(0.05)
    return False


def outcome(result: Any, prefix: str) -> Any:
    """States and results of the whole result tree, normalised, in a stable order."""
    described = []
    for node in _nodes(result):
        if isinstance(node, GroupResult):
            described.append(["group", len(node.results)])
        else:
            described.append([node.state, normalise(node.result, prefix)])
    return sorted(described, key=repr)


def run(side: Side, capture: Capture, scenario: Scenario, nonce: int,
        timeout: float = 10) -> dict[str, Any]:
    """Run ``scenario`` on ``side``; return its messages, executions and outcome, normalised."""
    side.runs.clear()
    side.set_routes(scenario.routes)
    capture.take()
    raised = None
    result = None
    try:
        result = call(side, scenario, nonce)
    except Exception as exc:
        raised = normalise(exc, side.prefix)
    started = time.monotonic()
    settled = settle(side, result, lambda: len(capture.messages), timeout)
    if os.environ.get("DEDUP_PARITY_TIMING"):
        print(f"{side.label} {time.monotonic() - started:.2f}s {scenario}")
    messages = [describe_message(m, side.prefix) for m in capture.take()]
    return {
        "raised": raised,
        "settled": settled,
        "messages": sorted(messages, key=sort_key),
        "runs": sorted((normalise(r, side.prefix) for r in side.runs.all()), key=repr),
        "outcome": None if result is None else outcome(result, side.prefix),
    }


def describe_difference(plain: Mapping[str, Any], dedup: Mapping[str, Any]) -> str:
    """A readable account of where two runs differ."""
    lines = []
    for part in ("raised", "settled", "runs", "outcome"):
        if plain[part] != dedup[part]:
            lines.append(f"{part}:\n  plain: {plain[part]!r}\n  dedup: {dedup[part]!r}")
    if plain["messages"] != dedup["messages"]:
        if len(plain["messages"]) != len(dedup["messages"]):
            lines.append(f"message count: plain {len(plain['messages'])}, "
                         f"dedup {len(dedup['messages'])}")
        for p, d in zip(plain["messages"], dedup["messages"], strict=False):
            for key in sorted(set(p) | set(d)):
                if p.get(key) != d.get(key):
                    lines.append(f"message {key}:\n  plain: {p.get(key)!r}\n  "
                                 f"dedup: {d.get(key)!r}")
    return "\n".join(lines)


def crc(text: str) -> int:
    """A small stable number for ``text`` (nonces that differ per example)."""
    return zlib.crc32(text.encode()) % 10_000_000
