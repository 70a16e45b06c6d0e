"""Which calls are "the same": canonical arguments, strategies and key digests.

A lock key is ``{prefix}:{task name}:{sha256 hex}``. Raw arguments and caller
keys never appear in a key, a log line or an exception message.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import math
import operator
import os
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import date, datetime, time, timezone
from decimal import Decimal
from enum import Enum
from typing import Any, Final, Literal

from .exceptions import DedupKeyError, InvalidOptionError

__all__ = [
    "ArgumentBinder",
    "Identity",
    "as_delivered",
    "bound_queue",
    "canonical_json",
    "deterministic_task_id",
    "digest",
    "lock_key",
    "time_bucket",
]

#: uuid5 namespace of deterministic task ids (uuid5(NAMESPACE_URL, "celery-dedup")).
TASK_ID_NAMESPACE: Final = uuid.uuid5(uuid.NAMESPACE_URL, "https://pypi.org/project/celery-dedup/")

Granularity = Literal["minute", "hour", "day", "week", "month"]
_BUCKET_FORMATS: Final[Mapping[str, str]] = {
    "minute": "%Y-%m-%dT%H:%M",
    "hour": "%Y-%m-%dT%H",
    "day": "%Y-%m-%d",
    "month": "%Y-%m",
}


class Identity(str, Enum):
    """How the identity of a call is derived when no ``deduplication_key`` is given."""

    #: task name, target queue and the bound arguments
    STRICT = "strict"
    #: the caller must pass ``deduplication_key``
    CALLER_PROVIDED = "caller_provided"
    #: no lock unless a ``deduplication_key`` is given
    ALWAYS_UNIQUE = "always_unique"


def _escape_key(key: str) -> str:
    # Tagged values use keys starting with "$"; escaping user keys that start
    # with "$" keeps a user dict from ever looking like a tagged value.
    return "$" + key if key.startswith("$") else key


def _canonical(value: Any, path: str) -> Any:
    """Turn ``value`` into plain JSON data, deterministically, or raise."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DedupKeyError(
                f"argument {path!r} is {value!r}, which has no canonical form "
                "(NaN and infinities are not equal to themselves)",
                argument=path,
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        return _canonical_mapping(value, path)
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, time):
        return {"$time": value.isoformat()}
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise DedupKeyError(
                f"argument {path!r} is Decimal({str(value)!r}), which has no canonical form",
                argument=path,
            )
        return {"$decimal": str(value.normalize())}
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Enum):
        return {"$enum": f"{type(value).__qualname__}", "value": _canonical(value.value, path)}
    kind = type(value).__name__
    hint = "a sorted list" if isinstance(value, (set, frozenset)) else "plain JSON data"
    raise DedupKeyError(
        f"argument {path!r} of type {kind} cannot be part of a deduplication key; "
        f"pass {hint}, restrict the identity with unique_on=, or pass deduplication_key=",
        argument=path,
    )


def _canonical_mapping(value: Mapping[Any, Any], path: str) -> Any:
    if all(isinstance(k, str) for k in value):
        return {_escape_key(k): _canonical(v, f"{path}[{k!r}]") for k, v in value.items()}
    pairs = [
        (_canonical(k, f"{path}<key {k!r}>"), _canonical(v, f"{path}[{k!r}]"))
        for k, v in value.items()
    ]
    pairs.sort(key=lambda kv: json.dumps(kv[0], sort_keys=True))
    return {"$map": [list(pair) for pair in pairs]}


#: one encoder for every identity (``json.dumps`` with options builds one per call)
_CANONICAL_ENCODER: Final = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False
)


def canonical_json(value: Any, argument: str = "value") -> str:
    """Canonical JSON of ``value``: sorted keys, no whitespace, typed special values.

    ``1`` and ``"1"`` differ, dict order never matters, list order does.
    Raises ``DedupKeyError`` naming ``argument`` (and the path inside it) for
    sets, arbitrary objects, NaN and infinities.
    """
    return json.dumps(
        _canonical(value, argument),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def digest(material: str) -> str:
    """The first 128 bits of the sha256 of ``material``, 32 hex characters.

    Lone surrogates are kept, as JSON keeps them. 128 bits keep collisions
    out of reach (2**64 distinct identities of one task before one is
    likely) and the key short enough for a compact store record.
    """
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:32]


_EMPTY: Final = inspect.Parameter.empty

#: Serializers whose round trip changes nothing a key depends on.
_IDENTITY_SERIALIZERS: Final = frozenset({"pickle"})


def as_delivered(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, serializer: str
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """The arguments as the worker will receive them: through ``serializer`` and back.

    So the producer's key and the worker's (``send_task`` guard, native
    mode) agree by construction: ``{1: 9.5}`` is keyed as ``{"1": 9.5}``
    under JSON, where the task receives exactly that. A value the serializer
    cannot encode raises the serializer's error, as publishing it would.
    """
    if serializer in _IDENTITY_SERIALIZERS:
        return args or (), kwargs or {}
    if serializer == "json":
        args, kwargs = args or (), kwargs or {}
        if _plain_scalars(args) and _plain_scalars(kwargs.values()) and all(
            type(name) is str for name in kwargs
        ):
            return args, kwargs
        if _json_stable(args) and _json_stable(kwargs):
            # Plain JSON data comes back unchanged: skip the encode/decode round trip.
            return list(args), dict(kwargs)
    from kombu.serialization import dumps, loads

    content_type, encoding, data = dumps([list(args or ()), dict(kwargs or {})], serializer)
    # Only the round trip is asked here: whether workers accept the content
    # type is theirs to say (Celery's eager path loads it the same way).
    delivered_args, delivered_kwargs = loads(data, content_type, encoding, accept=[content_type])
    return delivered_args, delivered_kwargs


_SCALARS: Final = frozenset({str, int, float, bool, type(None)})


def _plain_scalars(values: Iterable[Any]) -> bool:
    """Whether every value is a JSON scalar that is its own canonical form.

    The common case (ids, names, flags): no round trip, no canonicalisation.
    """
    for value in values:
        kind = type(value)
        if kind not in _SCALARS or (kind is float and not math.isfinite(value)):
            return False
    return True


def _all_scalars(values: Collection[Any]) -> bool:
    """``_plain_scalars`` for a long list or a dict's values: the types collected in one pass."""
    kinds = set(map(type, values))
    if not kinds <= _SCALARS:
        return False
    return float not in kinds or all(math.isfinite(v) for v in values if type(v) is float)


_STARTS_WITH_DOLLAR: Final = operator.methodcaller("startswith", "$")


_encode_string: Final = json.encoder.encode_basestring  # the encoder's own, as ensure_ascii=False


def _scalar_json(value: Any) -> str:
    """A plain scalar (``_plain_scalars``) as ``_CANONICAL_ENCODER`` writes it."""
    kind = type(value)
    if kind is str:
        return _encode_string(value)
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        return float.__repr__(value)
    if value is None:
        return "null"
    return "true" if value else "false"


def _json_stable(value: Any, depth: int = 0) -> bool:
    """Whether a JSON round trip returns ``value`` unchanged (exact types, str keys).

    A top-level tuple is fine (arguments are delivered as a list and bound
    positionally); a nested one is not (it comes back a list). Non-finite
    floats are left to the round trip (and then refused by the key).
    """
    kind = type(value)
    if kind in _SCALARS:
        return kind is not float or math.isfinite(value)
    if depth > 32:
        return False
    if kind is list or (kind is tuple and depth == 0):
        return _all_scalars(value) or all(_json_stable(item, depth + 1) for item in value)
    if kind is dict:
        if set(map(type, value)) - {str}:
            return False
        values = value.values()
        return _all_scalars(values) or all(_json_stable(item, depth + 1) for item in values)
    return False


def _as_is(value: Any, depth: int = 0) -> bool:
    """Whether ``_canonical(value)`` encodes to the same JSON as ``value`` itself.

    JSON data of exact types (tuples encode as lists), finite floats, no
    dict key starting with "$" (those are escaped).
    """
    kind = type(value)
    if kind in _SCALARS:
        return kind is not float or math.isfinite(value)
    if depth > 32:
        return False
    if kind is list or kind is tuple:
        return _all_scalars(value) or all(_as_is(item, depth + 1) for item in value)
    if kind is dict:
        if set(map(type, value)) - {str} or any(map(_STARTS_WITH_DOLLAR, value)):
            return False
        values = value.values()
        return _all_scalars(values) or all(_as_is(item, depth + 1) for item in values)
    return False


def lock_key(prefix: str, task_name: str, material: str) -> str:
    """The store key for ``material`` (a canonical identity or a caller key)."""
    return f"{prefix}:{task_name}:{digest(material)}"


def bound_queue(queues: Iterable[Any], exchange: str, routing_key: str | None) -> str | None:
    """The name of the first of ``queues`` bound to ``exchange`` by ``routing_key``, if any.

    How both the producer and the worker name the queue of a message
    published to an exchange and a routing key (a route naming no queue):
    the key's queue part is the same on both sides by construction.
    """
    for queue in queues:
        if queue.routing_key == routing_key and (queue.exchange.name or "") == exchange:
            return str(queue.name)
    return None


#: the version (4) and variant (RFC 4122) bits of a random uuid
_UUID4_CLEAR: Final = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET: Final = (0x4000 << 64) | (0x8000 << 48)


def new_task_id() -> str:
    """A random task id: a version 4 uuid string, as Celery's ``uuid()`` makes.

    Written from the random bits directly: the ``UUID`` object Celery's
    builds is only ever turned into this string.
    """
    bits = int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET
    text = f"{bits:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def deterministic_task_id(key: str) -> str:
    """A task id derived from a lock key (uuid5), the same for every producer."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, key))


def time_bucket(granularity: Granularity | str, when: datetime | None = None) -> str:
    """The UTC bucket of ``when`` (default: now) for time-windowed keys.

    ``minute`` → ``2026-11-22T14:05``, ``hour`` → ``2026-11-22T14``,
    ``day`` → ``2026-11-22``, ``week`` → ``2026-W47`` (ISO week), ``month`` →
    ``2026-11``. Naive datetimes are taken as UTC; aware ones are converted.
    """
    moment = datetime.now(timezone.utc) if when is None else when
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    moment = moment.astimezone(timezone.utc)
    if granularity == "week":
        year, week, _ = moment.isocalendar()
        return f"{year}-W{week:02d}"
    try:
        return moment.strftime(_BUCKET_FORMATS[granularity])
    except KeyError:
        raise InvalidOptionError(
            "granularity", granularity, ["minute", "hour", "day", "week", "month"]
        ) from None


class ArgumentBinder:
    """Binds call arguments to a task's signature, built once per task.

    ``f(1, b=2)``, ``f(a=1, b=2)`` and ``f(1, 2)`` bind to the same mapping,
    with defaults applied; ``unique_on`` restricts it to the named parameters.
    """

    def __init__(
        self, func: Callable[..., Any], task_name: str, unique_on: Sequence[str] | None = None
    ) -> None:
        self.signature = inspect.signature(func)
        self.task_name = task_name
        self.unique_on: tuple[str, ...] | None = None
        if unique_on is not None:
            names = (unique_on,) if isinstance(unique_on, str) else tuple(unique_on)
            unknown = [n for n in names if n not in self.signature.parameters]
            if unknown:
                raise InvalidOptionError("unique_on", unique_on, list(self.signature.parameters))
            self.unique_on = names
        parameters = list(self.signature.parameters.values())
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
        #: parameter names and defaults when ``_bind_simple`` applies (no ``*args``…)
        self._names = tuple(p.name for p in parameters) if plain else None
        self._defaults = {p.name: p.default for p in parameters}
        #: ``positional_identity``: the parameters' positions in sorted-name order,
        #: each with its JSON-encoded name (``"name":``), and the head per queue
        self._sorted_fields = tuple(
            (_encode_string(name) + ":", i) for name, i in sorted(
                (name, i) for i, name in enumerate(self._names or ())
            )
        )  # fmt: skip
        self._heads: dict[str | None, str] = {}

    def bind(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The arguments of a call as ``{parameter: value}`` with defaults applied."""
        return self._restrict(self.bind_all(args, kwargs))

    def bind_all(
        self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """``bind`` ignoring ``unique_on``: every parameter of the call."""
        arguments = self._bind_simple(args, kwargs)
        if arguments is not None:
            return arguments
        try:
            bound = self.signature.bind(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise TypeError(f"{self.task_name}{self.signature}: {exc}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def _restrict(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if self.unique_on is None:
            return arguments
        return {name: arguments[name] for name in self.unique_on}

    def _bind_simple(
        self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        """``bind`` without ``inspect`` for plain parameters, or ``None`` to bind generically.

        Handles only calls that bind without error to a signature of plain
        positional-or-keyword parameters; anything else (``*args``, keyword-only,
        a missing or unknown argument) goes through ``Signature.bind``,
        which gives the same mapping or raises the error.
        """
        names, defaults = self._names, self._defaults
        if names is None:
            return None
        given = tuple(args or ())
        if len(given) > len(names):
            return None
        arguments = dict(zip(names, given, strict=False))
        for name, value in (kwargs or {}).items():
            if name in arguments or name not in defaults:
                return None
            arguments[name] = value
        if len(arguments) < len(names):
            for name in names[len(given) :]:
                if name not in arguments:
                    default = defaults[name]
                    if default is _EMPTY:
                        return None
                    arguments[name] = default
        # Parameter order, as Signature.bind gives it.
        return {name: arguments[name] for name in names}


    def positional_identity(self, queue: str | None, args: Sequence[Any]) -> str | None:
        """``identity`` of a call passing every parameter positionally as a plain scalar.

        The common call (``task.delay(user_id, "name")``) in one step: the same
        string ``identity`` returns, or ``None`` when the call is not of that
        shape (the caller then takes the general path).
        """
        names = self._names
        if names is None or self.unique_on is not None or len(args) != len(names):
            return None
        if not _plain_scalars(args):
            return None
        # The exact text ``_material`` encodes, written field by field: the
        # encoder would be set up again on every call for the same few scalars.
        head = self._heads.get(queue)
        if head is None:
            head = self._heads[queue] = _CANONICAL_ENCODER.encode(
                ["strict", self.task_name, queue]
            )[:-1] + ","
        fields = ",".join([name + _scalar_json(args[i]) for name, i in self._sorted_fields])
        return f"{head}{{{fields}}}]"

    def _material(self, queue: str | None, canonical_args: Mapping[str, Any]) -> str:
        return _CANONICAL_ENCODER.encode(["strict", self.task_name, queue, canonical_args])

    def identity(
        self,
        queue: str | None,
        args: Iterable[Any] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> str:
        """Canonical JSON of ``(task name, queue, bound arguments)``."""
        arguments = self.bind(args, kwargs)
        if not any(n.startswith("$") for n in arguments) and (
            _plain_scalars(arguments.values()) or all(map(_as_is, arguments.values()))
        ):
            # Their own canonical form (JSON data): the same text, without
            # building a copy of every list and dict on the way.
            return self._material(queue, arguments)
        try:
            canonical_args = {
                _escape_key(name): _canonical(value, name) for name, value in arguments.items()
            }
        except DedupKeyError as exc:
            raise DedupKeyError(
                f"{self.task_name}: {exc}", argument=exc.argument, task_name=self.task_name
            ) from None
        except RecursionError:
            name = next(
                (name for name, value in arguments.items() if _too_deep(value, name)), "?"
            )
            raise DedupKeyError(
                f"{self.task_name}: argument {name!r} nests too deeply to be part of a "
                "deduplication key; pass deduplication_key= or restrict unique_on=",
                argument=name,
                task_name=self.task_name,
            ) from None
        return self._material(queue, canonical_args)


def _too_deep(value: Any, name: str) -> bool:
    try:
        _canonical(value, name)
    except RecursionError:
        return True
    except DedupKeyError:
        return False
    return False


def caller_key_material(key: str) -> str:
    """Identity material of a caller-given ``deduplication_key``."""
    return json.dumps(["key", key], separators=(",", ":"), ensure_ascii=False)
