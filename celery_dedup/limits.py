"""Per-key limits: how many bodies run at once, how many publishes per period.

Two task options, each with a key of its own (a ``str.format`` template over
the call's bound arguments such as ``"{user}"``, a callable taking the
call's arguments, or by default the deduplication key). Each limit is a
value or a callable of the call's arguments returning one (a customer's
tier), evaluated with the key, once per call (``concurrency_for``,
``rate_for``):

* ``concurrency_limit=N`` (``concurrency_key=``): at most ``N`` bodies with
  the same key run at once across every worker. A message over the limit
  is **deferred**: the worker publishes the very same message again with a
  countdown (a third of the slot lease, jittered between half and all of
  it: ``concurrency_backoff=`` overrides it) and acknowledges this copy,
  so no pool slot waits and nothing is lost or failed. A slot is a lease
  (``dedup_lease_ttl``) renewed every third of it by the process running
  the body, so a killed worker's slot comes back within one lease.
* ``rate_limit_per_key="10/m"`` (``/s``, ``/m``, ``/h``, ``/d``; ``rate_key=``):
  at most that many publishes per key in any sliding window of the
  period, counted on the store's clock. A call over it raises
  ``RateLimited`` (with ``retry_after``), or, with ``on_rate_limit="delay"``,
  is published with a countdown to its place in the window
  (``"last_publish"``: answered with the most recent admitted publish's
  handle). A canvas member or a worker-side publish is always delayed.

Stores keep them through ``SlotSupport`` and ``RateSupport``; a task using
a limit on a store without them fails loudly (``LimitsNotSupported``).
This module holds the options, the keys and what the CLI shows; the worker
side is ``slots``, the producer side ``rates``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .exceptions import InvalidOptionError, LimitsNotSupported
from .identity import digest
from .options import naming_task, validate_choice
from .stores.base import LimitListing, RateSupport, SlotSupport

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = [
    "LIMIT_OPTIONS",
    "KeySpec",
    "Limits",
    "OnRateLimit",
    "Rate",
    "concurrency_for",
    "concurrency_store_key",
    "key_text",
    "limits_of",
    "live_keys",
    "parse_rate",
    "rate_for",
    "rate_store_key",
    "rates_of",
    "slots_of",
    "usage",
    "usage_lines",
]

#: the task attributes this module reads
LIMIT_OPTIONS: Final = (
    "concurrency_limit",
    "concurrency_key",
    "concurrency_backoff",
    "rate_limit_per_key",
    "rate_key",
    "on_rate_limit",
)

T = TypeVar("T")

_PERIODS: Final[Mapping[str, float]] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smhd])\s*$")


class OnRateLimit(str, Enum):
    """What a call over ``rate_limit_per_key`` does (outside a canvas and a worker)."""

    #: raise ``RateLimited`` (the default)
    RAISE = "raise"
    #: the name 0.3 gave the default; a refusal now always raises (see ``RAISE``)
    DUPLICATE = "duplicate"
    #: publish it with a countdown to its place in the window
    DELAY = "delay"
    #: return the handle of the most recent admitted publish of the rate key
    #: (another call's: asked for by name only)
    LAST_PUBLISH = "last_publish"


@dataclass(frozen=True)
class Rate:
    """A parsed ``rate_limit_per_key``: ``limit`` publishes per ``period`` seconds."""

    limit: int
    period: float


_RATE_TEXT: Final = "a string 'N/s', 'N/m', 'N/h' or 'N/d' with N >= 1"


def parse_rate(value: Any, option: str = "rate_limit_per_key") -> Rate | None:
    """``"10/m"`` as a ``Rate`` (``None`` stays ``None``); anything else is refused."""
    if value is None:
        return None
    rate = _rate_or_none(value)
    if rate is None:
        raise InvalidOptionError(option, value, f"{_RATE_TEXT} (or None)")
    return rate


def _rate_or_none(value: Any) -> Rate | None:
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < 1:
        return None
    return Rate(int(match.group(1)), _PERIODS[match.group(2)])


def _positive_int(value: Any, option: str) -> int | None:
    if value is None:
        return None
    if not _is_positive_int(value):
        raise InvalidOptionError(option, value, "an int >= 1, a callable (or None)")
    return int(value)


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


#: a limit option given as a callable of the call's arguments
LimitCallable = Callable[..., Any]


def _concurrency_spec(value: Any) -> int | LimitCallable | None:
    if callable(value) and not isinstance(value, type):
        spec: LimitCallable = value
        return spec
    return _positive_int(value, "concurrency_limit")


def _rate_spec(value: Any) -> Rate | LimitCallable | None:
    if callable(value) and not isinstance(value, type):
        spec: LimitCallable = value
        return spec
    if value is None:
        return None
    rate = _rate_or_none(value)
    if rate is None:
        raise InvalidOptionError(
            "rate_limit_per_key", value, f"{_RATE_TEXT}, a callable (or None)"
        )
    return rate


def _backoff(value: Any, option: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise InvalidOptionError(option, value, "a number of seconds greater than 0 (or None)")
    return float(value)


#: a key option: a template, a callable, or None (the deduplication key)
KeySpec = str | Callable[..., Any] | None


@dataclass(frozen=True)
class Limits:
    """A task's limits, validated once."""

    #: the limit, or a callable of the call's arguments returning it (``concurrency_for``)
    concurrency: int | LimitCallable | None
    concurrency_key: KeySpec
    backoff: float | None
    #: the rate, or a callable of the call's arguments returning one (``rate_for``)
    rate: Rate | LimitCallable | None
    rate_key: KeySpec
    on_rate_limit: OnRateLimit
    signature: inspect.Signature


def _key_spec(value: Any, option: str, signature: inspect.Signature) -> KeySpec:
    if value is None or callable(value):
        spec: KeySpec = value
        return spec
    if not isinstance(value, str) or not value:
        raise InvalidOptionError(
            option, value, "a template over the arguments ('{user}'), a callable, or None"
        )
    names = {name for _, name, _, _ in string.Formatter().parse(value) if name}
    fields = {re.split(r"[.\[]", name, maxsplit=1)[0] for name in names}
    unknown = fields - set(signature.parameters)
    if unknown or not fields:
        raise InvalidOptionError(
            option,
            value,
            f"a template naming parameters of the task ({', '.join(signature.parameters)})",
        )
    return value


def limits_of(task: DedupTask) -> Limits | None:
    """The task's limits (``None`` when it has none), validated on first use."""
    cached: Limits | bool | None = task.__dict__.get("_dedup_limits", False)
    if cached is not False:
        return cached if isinstance(cached, Limits) else None
    with naming_task(task.name):
        limits = _build(task)
    task.__dict__["_dedup_limits"] = limits
    return limits


def _build(task: DedupTask) -> Limits | None:
    def attr(name: str) -> Any:
        return getattr(task, name, None)

    concurrency = _concurrency_spec(attr("concurrency_limit"))
    rate = _rate_spec(attr("rate_limit_per_key"))
    if concurrency is None and rate is None:
        return None
    signature = inspect.signature(task.run)
    on_rate_limit = attr("on_rate_limit")
    return Limits(
        concurrency=concurrency,
        concurrency_key=_key_spec(attr("concurrency_key"), "concurrency_key", signature),
        backoff=_backoff(attr("concurrency_backoff"), "concurrency_backoff"),
        rate=rate,
        rate_key=_key_spec(attr("rate_key"), "rate_key", signature),
        on_rate_limit=(
            OnRateLimit.RAISE
            if on_rate_limit is None
            else validate_choice(OnRateLimit, on_rate_limit, "on_rate_limit")
        ),
        signature=signature,
    )


def key_text(
    task: DedupTask,
    limits: Limits,
    spec: KeySpec,
    option: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    default: str | None,
) -> str:
    """The text of a limit's key for one call."""
    if spec is None:
        # No deduplication key (identity="always_unique"): the task as a whole.
        return default if default is not None else task.name
    if callable(spec):
        value = spec(*(args or ()), **(kwargs or {}))
        if not isinstance(value, str) or not value:
            raise InvalidOptionError(
                option, value, "the callable to return a non-empty string", task.name
            )
        return value
    try:
        bound = limits.signature.bind(*(args or ()), **(kwargs or {}))
        bound.apply_defaults()
        return _ARGUMENTS.vformat(spec, (), bound.arguments)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        allowed = f"a template this call's arguments fill (here: {type(exc).__name__}: {exc})"
        raise InvalidOptionError(option, spec, allowed, task.name) from exc


def concurrency_for(
    task: DedupTask, limits: Limits, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> int:
    """The ``concurrency_limit`` of one call (its callable's answer, checked).

    Evaluated where the call's ``concurrency_key`` is (the worker, before
    the body): a limit that changes between calls applies to the next call.
    """
    spec = limits.concurrency
    assert spec is not None
    if not callable(spec):
        return spec
    value = spec(*(args or ()), **(kwargs or {}))
    if not _is_positive_int(value):
        raise InvalidOptionError(
            "concurrency_limit", value, "the callable to return an int >= 1", task.name
        )
    return int(value)


def rate_for(
    task: DedupTask, limits: Limits, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> Rate:
    """The ``rate_limit_per_key`` of one call (its callable's answer, parsed and checked).

    Evaluated where the call's ``rate_key`` is (``apply_async``, before the
    window is counted).
    """
    spec = limits.rate
    assert spec is not None
    if not callable(spec):
        return spec
    value = spec(*(args or ()), **(kwargs or {}))
    rate = _rate_or_none(value)
    if rate is None:
        raise InvalidOptionError(
            "rate_limit_per_key", value, f"the callable to return {_RATE_TEXT}", task.name
        )
    return rate


class _ArgumentFormatter(string.Formatter):
    """``str.format`` over a call's arguments, where ``{order.customer_id}`` also
    reads the item of a mapping.

    A ``pydantic=True`` task's model argument is dumped to a dict when it is
    published: the producer and the worker see that dict, and the template
    the docs write for the model names the same value on both.
    """

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        first, rest = _split_field(field_name)
        value = self.get_value(first, args, kwargs)
        for is_attribute, name in rest:
            if is_attribute and isinstance(value, Mapping) and name in value:
                value = value[name]
            elif is_attribute:
                value = getattr(value, name)
            else:
                value = value[name]
        return value, first


_ARGUMENTS: Final = _ArgumentFormatter()
#: what ``string.Formatter.get_field`` splits a field name with
_split_field: Final[Any] = importlib.import_module("_string").formatter_field_name_split


def concurrency_store_key(prefix: str, task_name: str, text: str) -> str:
    """The store key of the slots of one concurrency key of ``task_name``."""
    return f"{prefix}-slots:{task_name}:{digest(text)}"


def rate_store_key(prefix: str, task_name: str, text: str) -> str:
    """The store key of the publish window of one rate key of ``task_name``."""
    return f"{prefix}-rate:{task_name}:{digest(text)}"


def slots_of(task: DedupTask, store: object) -> SlotSupport:
    if isinstance(store, SlotSupport):
        return store
    raise LimitsNotSupported(task.name, "concurrency_limit", getattr(store, "name", "none"))


def rates_of(task: DedupTask, store: object) -> RateSupport:
    if isinstance(store, RateSupport):
        return store
    raise LimitsNotSupported(task.name, "rate_limit_per_key", getattr(store, "name", "none"))


# -- what the CLI shows ---------------------------------------------------------


def usage(task: DedupTask, text: str) -> dict[str, Any]:
    """The slots and the publish window of one key of ``task`` (its text: ``"user-1"``).

    ``text`` is what the task's key yields for a call: the value of its
    ``concurrency_key``/``rate_key`` template or callable, or the lock key
    when the key is the deduplication key. One round trip per limit. A
    limit given as a callable is the call's, not the key's: it shows as
    ``None`` (and a callable rate's window counts every entry the key keeps).
    """
    limits = limits_of(task)
    if limits is None:
        return {"task": task.name, "key": text, "digest": digest(text)}
    runtime = task.dedup_config().runtime
    prefix = runtime.settings.key_prefix
    found: dict[str, Any] = {"task": task.name, "key": text, "digest": digest(text)}
    if limits.concurrency is not None:
        slots = slots_of(task, runtime.store)
        found["concurrency"] = {
            "limit": None if callable(limits.concurrency) else limits.concurrency,
            "in_use": slots.slots_in_use(concurrency_store_key(prefix, task.name, text)),
        }
    if limits.rate is not None:
        rates = rates_of(task, runtime.store)
        # A callable's rate is the call's: read the window over the longest period.
        rate = limits.rate if isinstance(limits.rate, Rate) else None
        limit, period = (rate.limit, rate.period) if rate else (1 << 30, _PERIODS["d"])
        answer = rates.rate_window(rate_store_key(prefix, task.name, text), limit, period)
        found["rate"] = {
            "limit": None if rate is None else rate.limit,
            "period": None if rate is None else rate.period,
            "count": answer.count,
            "free_in": answer.wait,
            "last_task_id": answer.last,
        }
    return found


def usage_lines(found: Mapping[str, Any]) -> list[str]:
    """``usage`` as the CLI prints it."""
    lines = [f"{found['task']}  key {found['key']!r}  (digest {found['digest'][:16]})"]
    if "concurrency" not in found and "rate" not in found:
        return [*lines, "  no concurrency_limit or rate_limit_per_key"]
    if "concurrency" in found:
        slots = found["concurrency"]
        limit = "a per-call limit" if slots["limit"] is None else slots["limit"]
        lines.append(f"  concurrency  {slots['in_use']} of {limit} slots in use")
    if "rate" in found:
        rate = found["rate"]
        if rate["limit"] is None:
            line = f"  rate         {rate['count']} publishes in the window (a per-call rate)"
        else:
            line = (
                f"  rate         {rate['count']} of {rate['limit']} publishes "
                f"in the last {rate['period']:g}s"
            )
        if rate["free_in"]:
            line += f", next free in {rate['free_in']:.1f}s"
        lines.append(line)
        if rate["last_task_id"]:
            lines.append(f"  last publish {rate['last_task_id']}")
    return lines


def _split(store_key: str, kind: str) -> tuple[str, str]:
    """``(task name, digest)`` of ``<prefix>-<kind>:<task name>:<digest>``."""
    rest = store_key.split(f"-{kind}:", 1)[-1]
    task_name, _, hashed = rest.rpartition(":")
    return task_name, hashed


def _fixed(spec: T | LimitCallable | None) -> T | None:
    """A limit given as a value; ``None`` for a callable's (each call has its own)."""
    return None if spec is None or callable(spec) else spec


def _slot_limit(limits: Limits | None, recorded: int | None) -> int | None:
    """The limit a key's listing shows: the task's, or for a callable the one its
    newest slot was taken under."""
    if limits is None:
        return None
    fixed = _fixed(limits.concurrency)
    return fixed if fixed is not None else recorded


def _own_limits(tasks: Mapping[str, Any], name: str) -> Limits | None:
    task = tasks.get(name)
    if task is None or not hasattr(task, "dedup_config"):
        return None
    return limits_of(task)


def live_keys(
    store: object, prefix: str, tasks: Mapping[str, Any], task_name: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every live concurrency key (slots in use) and rate key (publishes in the window).

    ``tasks`` (the app's registry) gives each key its task's limit and
    period; a key of a task no longer registered (or no longer limited)
    shows its store's count and a ``None`` limit. Keys name the task and
    the digest of the limit key's text: the text itself is never stored.
    One SCAN (Redis) or one SELECT (PostgreSQL) per kind.
    """
    if not isinstance(store, LimitListing):
        raise LimitsNotSupported(task_name or "", "a listing of the limit keys",
                                 getattr(store, "name", "none"))
    scope = f"{task_name}:" if task_name else ""
    concurrency = []
    for slot in store.list_slots(f"{prefix}-slots:{scope}"):
        name, hashed = _split(slot.key, "slots")
        limits = _own_limits(tasks, name)
        concurrency.append({
            "task": name,
            "digest": hashed,
            "in_use": slot.in_use,
            "limit": _slot_limit(limits, slot.limit),
        })
    rates = []
    for window in store.list_rates(f"{prefix}-rate:{scope}"):
        name, hashed = _split(window.key, "rate")
        limits = _own_limits(tasks, name)
        rate = _fixed(None if limits is None else limits.rate)
        if rate is None and limits is not None and window.rate is not None:
            # A callable's rate: the one the newest publish was admitted under.
            rate = Rate(*window.rate)
        ages = [age for age in window.ages if rate is None or age < rate.period]
        if not ages:
            continue
        free_in = 0.0
        if rate is not None and len(ages) >= rate.limit:
            # the window has room once its limit-th newest entry leaves it
            free_in = max(0.0, rate.period - ages[rate.limit - 1])
        rates.append({
            "task": name,
            "digest": hashed,
            "count": len(ages),
            "limit": None if rate is None else rate.limit,
            "period": None if rate is None else rate.period,
            "free_in": free_in,
            "last_task_id": window.last,
        })
    order = lambda row: (row["task"], row["digest"])  # noqa: E731
    return {"concurrency": sorted(concurrency, key=order), "rate": sorted(rates, key=order)}

