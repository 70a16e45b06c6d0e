"""Option resolution and validation.

Options come from four places, highest first: the call
(``apply_async(unique_for=…)``, ``sig.set(…)``), the task's attributes, the
app's ``dedup_*`` settings, then the defaults below. The task, the Django
system checks and the CLI all use the validators defined here.

Misspelt option names are not ignored silently: an unknown name that looks
like a celery-dedup option (``unique_untill``, ``unqiue_for``,
``dedup_default_tll``) given to a task, a call or the app's settings emits a
``DedupConfigWarning`` with a "did you mean", once per task and name.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Final, TypeVar

from .exceptions import InvalidOptionError
from .identity import Identity
from .key_reuse import OnKeyReuse
from .native import Native
from .policy import UniqueUntil
from .registry import CALL_NAMES, SETTING_NAMES, TASK_NAMES

__all__ = [
    "CALL_OPTIONS",
    "DEFAULTS",
    "KNOWN_SETTINGS",
    "NOT_GIVEN",
    "SETTINGS",
    "TASK_OPTIONS",
    "DedupConfigWarning",
    "DedupMode",
    "Fallback",
    "OnDuplicate",
    "OnKeyReuse",
    "ResolvedOptions",
    "did_you_mean",
    "naming_task",
    "pop_call_options",
    "validate_bool",
    "validate_choice",
    "validate_lint_ids",
    "validate_max_wait",
    "validate_setting",
    "validate_signal",
    "validate_unique_for",
    "validate_wait",
    "warn_unknown_settings",
    "warn_unknown_task_options",
]


class _NotGiven:
    """Marker for "the caller did not pass this option" (``None`` means bypass)."""

    _instance: _NotGiven | None = None

    def __new__(cls) -> _NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False


NOT_GIVEN: Final = _NotGiven()


class OnDuplicate(str, Enum):
    """What ``apply_async`` does when the key is already held."""

    #: publish nothing; return a ``DeduplicatedResult`` for the holder
    EXISTING = "existing"
    #: raise ``DuplicateTaskError``
    RAISE = "raise"
    #: debounce: take the lock over, publish, revoke the old holder
    REPLACE = "replace"
    #: one run in progress plus one queued follow-up carrying the latest
    #: call's arguments (``coalesce``)
    KEEP_LAST = "keep_last"
    #: revoke the queued holder or terminate the running one, wait for the key, publish
    CANCEL_RUNNING = "cancel_running"


class DedupMode(str, Enum):
    """Whether celery-dedup's decisions are applied or only counted."""

    #: suppress duplicates, refuse over-limit calls, replace and cancel holders
    ENFORCE = "enforce"
    #: publish every call anyway; count (and signal) what enforcing would have done
    OBSERVE = "observe"


class Fallback(str, Enum):
    """What happens when no lock store can be used."""

    #: log a warning and publish without a lock
    OPEN = "open"
    #: raise ``DeduplicationUnavailable`` before publishing
    CLOSED = "closed"


E = TypeVar("E", bound=Enum)


def validate_choice(enum: type[E], value: Any, option: str) -> E:
    """Return ``value`` as a member of ``enum`` or raise ``InvalidOptionError``."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except (ValueError, TypeError):
        raise InvalidOptionError(option, value, [m.value for m in enum]) from None


#: The longest lock: ten years (every store holds it; a longer TTL overflows
#: some, e.g. Redis' millisecond expiries).
MAX_SECONDS: Final = 10 * 365 * 24 * 3600.0


def validate_unique_for(value: Any, option: str = "unique_for") -> float | None:
    """Seconds as a positive float up to ``MAX_SECONDS``; ``None`` or ``0`` mean "no lock"."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(
            option, value, "seconds as an int, float or timedelta greater than 0 (or None)"
        )
    else:
        seconds = float(value)
    if seconds == 0:
        return None
    if not 0 < seconds <= MAX_SECONDS:
        raise InvalidOptionError(
            option, value, f"a number of seconds greater than 0 and at most {MAX_SECONDS:.0f}"
        )
    return seconds


def validate_positive_seconds(value: Any, option: str) -> float:
    """Like ``validate_unique_for`` but ``None`` and ``0`` are refused."""
    seconds = validate_unique_for(value, option)
    if seconds is None:
        raise InvalidOptionError(
            option, value, f"a number of seconds greater than 0 and at most {MAX_SECONDS:.0f}"
        )
    return seconds


def validate_wait(value: Any, option: str) -> float:
    """Seconds to wait: a finite number ``>= 0`` (or a ``timedelta``); 0 does not wait."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise InvalidOptionError(option, value, "a number of seconds from 0 to 3600")
    return float(value)


def validate_max_wait(value: Any, option: str = "debounce_max_wait") -> float | None:
    """Seconds greater than 0 (or a ``timedelta``), or ``None`` for "no cap"."""
    if value is None:
        return None
    return validate_positive_seconds(value, option)


def validate_signal(value: Any, option: str = "cancel_signal") -> str:
    """A signal name this platform knows (``"SIGUSR1"``, ``"TERM"``), as ``SIG…``."""
    import signal

    name = value.upper() if isinstance(value, str) else None
    if name is not None and not name.startswith("SIG"):
        name = "SIG" + name
    if name is None or not isinstance(getattr(signal, name, None), signal.Signals):
        raise InvalidOptionError(option, value, "a signal name such as 'SIGUSR1' or 'SIGTERM'")
    return name


def validate_bool(value: Any, option: str) -> bool:
    """A real ``bool`` (no truthy strings)."""
    if not isinstance(value, bool):
        raise InvalidOptionError(option, value, "True or False")
    return value


def validate_key(value: Any, option: str = "deduplication_key") -> str | None:
    """A non-empty string, or ``None`` for "no caller key"."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidOptionError(option, value, "a non-empty string")
    return value


def validate_prefix(value: Any, option: str = "dedup_key_prefix") -> str:
    """A non-empty string with no whitespace."""
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise InvalidOptionError(option, value, "a non-empty string without whitespace")
    return value


def validate_store(value: Any, option: str = "dedup_store") -> str | None:
    """A store URL string or ``None`` (derive it from the result backend)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidOptionError(option, value, "a store URL string or None")
    return value


def validate_send_events(value: Any, option: str = "dedup_send_events") -> bool | None:
    """``None`` (follow ``task_send_sent_event``) or a bool."""
    return None if value is None else validate_bool(value, option)


#: a lint id as given to ``dedup_silenced_warnings`` or a task's ``dedup_silenced``
_LINT_ID: Final = re.compile(r"(celery_dedup\.)?[WI]1\d\d")


def validate_lint_ids(value: Any, option: str = "dedup_silenced_warnings") -> frozenset[str]:
    """Lint ids (``"W101"`` or ``"celery_dedup.W101"``) as a set of bare ids."""
    if value is None:
        return frozenset()
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidOptionError(option, value, 'a list of lint ids such as ["W101"]')
    ids = list(value)
    if not all(isinstance(i, str) and _LINT_ID.fullmatch(i) for i in ids):
        raise InvalidOptionError(option, value, 'a list of lint ids such as ["W101"]')
    return frozenset(i.rpartition(".")[2] for i in ids)


def validate_flush_interval(value: Any, option: str = "dedup_metrics_flush_interval") -> float:
    """Seconds between metric flushes: a finite number ``>= 0`` (0 flushes every count)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
        raise InvalidOptionError(option, value, "a number of seconds >= 0")
    return float(value)


#: setting name → (default, validator)
SETTINGS: Final[Mapping[str, tuple[Any, Callable[[Any, str], Any]]]] = {
    "dedup_store": (None, validate_store),
    "dedup_key_prefix": ("celery-dedup", validate_prefix),
    "dedup_default_ttl": (3600, validate_positive_seconds),
    "dedup_default_unique_until": (
        UniqueUntil.SUCCESS,
        lambda v, o: validate_choice(UniqueUntil, v, o),
    ),
    # unique_until="success": how long a failed run's key stays held (None: unique_for).
    "dedup_retry_window": (None, validate_max_wait),
    "dedup_default_identity": (Identity.STRICT, lambda v, o: validate_choice(Identity, v, o)),
    "dedup_default_on_duplicate": (
        OnDuplicate.EXISTING,
        lambda v, o: validate_choice(OnDuplicate, v, o),
    ),
    # Whether a caller's deduplication_key held for different arguments
    # raises, warns (default: loud, but no upgrade breaks) or is ignored.
    "dedup_on_key_reuse": (OnKeyReuse.WARN, lambda v, o: validate_choice(OnKeyReuse, v, o)),
    # "observe": every refusal is published anyway and counted (a rollout's first step).
    "dedup_mode": (DedupMode.ENFORCE, lambda v, o: validate_choice(DedupMode, v, o)),
    "dedup_fallback": (Fallback.OPEN, lambda v, o: validate_choice(Fallback, v, o)),
    "dedup_send_events": (None, validate_send_events),
    "dedup_metrics_flush_interval": (5.0, validate_flush_interval),
    "dedup_native": (Native.AUTO, lambda v, o: validate_choice(Native, v, o)),
    # How long a revoked owner stays refused (at least its lock's TTL): a
    # revoked message reaching a worker later than this runs if the key is free.
    "dedup_revoked_ttl": (86400, validate_positive_seconds),
    # The running lease of a started message: renewed by the worker's main
    # process every third of it; a crashed run's copy waits at most this long.
    "dedup_lease_ttl": (60, validate_positive_seconds),
    # How long a completed run's done marker refuses its late copies; None:
    # unique_for plus the transport's visibility_timeout (``runs.done_ttl_for``).
    "dedup_done_ttl": (None, validate_unique_for),
    # Settings-lint warnings (celery_dedup.lint) nobody wants to hear again.
    "dedup_silenced_warnings": ((), validate_lint_ids),
    # on_duplicate="cancel_running": how long a call waits for the cancelled
    # holder to free the key, and the signal that terminates a running one
    # (SIGUSR1: the prefork pool's soft time limit, SoftTimeLimitExceeded).
    "dedup_cancel_wait": (10.0, validate_wait),
    "dedup_cancel_signal": ("SIGUSR1", validate_signal),
}

DEFAULTS: Final[Mapping[str, Any]] = {name: spec[0] for name, spec in SETTINGS.items()}


def validate_setting(name: str, value: Any) -> Any:
    """Validate one ``dedup_*`` setting; the error names the setting."""
    return SETTINGS[name][1](value, name)


def read_setting(conf: Mapping[str, Any], name: str) -> Any:
    """Read and validate a ``dedup_*`` setting from ``app.conf``."""
    value = conf.get(name)
    if value is None:
        return DEFAULTS[name]
    return validate_setting(name, value)


#: per-call option → validator; these are popped from ``apply_async`` options.
CALL_OPTIONS: Final[Mapping[str, Callable[[Any, str], Any]]] = {
    "deduplication_key": validate_key,
    "unique_for": validate_unique_for,
    "unique_until": lambda v, o: validate_choice(UniqueUntil, v, o),
    "retry_window": validate_max_wait,
    "on_duplicate": lambda v, o: validate_choice(OnDuplicate, v, o),
    "identity": lambda v, o: validate_choice(Identity, v, o),
    "deterministic_id": validate_bool,
    "on_key_reuse": lambda v, o: validate_choice(OnKeyReuse, v, o),
    "debounce_max_wait": validate_max_wait,
    "cancel_wait": validate_wait,
    "cancel_signal": validate_signal,
    "dedup_mode": lambda v, o: validate_choice(DedupMode, v, o),
}


def pop_call_options(options: MutableMapping[str, Any], task_name: str = "") -> dict[str, Any]:
    """Pop and validate the dedup options of one ``apply_async`` call.

    Popping matters: Celery would publish unknown options as broker message
    properties. Options the caller did not pass are absent from the result.
    A misspelt dedup option warns (``DedupConfigWarning``); an invalid value
    raises ``InvalidOptionError`` naming ``task_name`` when given.
    """
    given: dict[str, Any] = {}
    with naming_task(task_name):
        for name, validate in CALL_OPTIONS.items():
            if name in options:
                given[name] = validate(options.pop(name), name)
    for name in [n for n in options if n in _TASK_ONLY]:
        # Celery would publish it as a broker message property, and nothing reads it there.
        options.pop(name)
        _warn_task_only(name, task_name)
    for name in options:
        if name not in _CELERY_CALL_OPTIONS:
            _warn_if_misspelt(name, CALL_OPTIONS, task_name, "call option")
    return given


# -- misspelt names and errors that name the task ---------------------------------


class DedupConfigWarning(UserWarning):
    """An option or setting name that looks like a misspelt celery-dedup one."""


#: the task attributes ``DedupTask`` reads (``registry``: limits included)
TASK_OPTIONS: Final = TASK_NAMES

#: every ``dedup_*`` setting celery-dedup reads
KNOWN_SETTINGS: Final = frozenset(SETTING_NAMES)

#: the prefixes that make an unknown name "dedup-like" even far from every known one
_DEDUP_PREFIXES: Final = (
    "unique_", "uniq_", "dedup", "deduplication", "on_dup", "determin", "concurrency_",
    "rate_limit_per", "on_rate",
)  # fmt: skip

# apply_async options of Celery itself (never warned about)
_CELERY_CALL_OPTIONS: Final = frozenset({
    "add_to_parent", "argsrepr", "chain", "chord", "compression", "connection", "countdown",
    "delivery_mode", "eta", "exchange", "exchange_type", "expires", "group_id", "group_index",
    "headers", "ignore_result", "immutable", "is_eager", "kwargsrepr", "link", "link_error",
    "mandatory", "parent_id", "priority", "producer", "publisher", "queue", "replaced_task_nesting",
    "reply_to", "retries", "retry", "retry_policy", "root_id", "routing_key", "serializer",
    "shadow", "soft_time_limit", "stamped_headers", "stamps", "subtask_type", "task_id",
    "task_type", "time_limit", "MessageGroupId", "MessageDeduplicationId",
})

_warned: set[tuple[str, str]] = set()


#: task options a call cannot set (``concurrency_limit``…)
_TASK_ONLY: Final = frozenset(TASK_NAMES) - frozenset(CALL_NAMES)


def _warn_task_only(name: str, task_name: str) -> None:
    if (task_name, name) in _warned:
        return
    _warned.add((task_name, name))
    where = f"{task_name}: " if task_name else ""
    warnings.warn(
        f"celery-dedup: {where}{name!r} is a task option, not a call option: it is ignored "
        f"here; set it on the task (@app.task({name}=...) or a subclass)",
        DedupConfigWarning,
        stacklevel=4,
    )


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (``difflib``), or ``None``."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return close[0] if close else None


def _warn_if_misspelt(name: str, known: Iterable[str], task_name: str, what: str) -> None:
    if name in known or (task_name, name) in _warned:
        return
    suggestion = did_you_mean(name, known)
    if suggestion is None and not name.lower().startswith(_DEDUP_PREFIXES):
        return
    _warned.add((task_name, name))
    where = f"{task_name}: " if task_name else ""
    hint = f"did you mean {suggestion!r}?" if suggestion else f"known: {', '.join(sorted(known))}"
    warnings.warn(
        f"celery-dedup: {where}unknown {what} {name!r} is ignored; {hint}",
        DedupConfigWarning,
        stacklevel=4,
    )


def warn_unknown_task_options(attributes: Mapping[str, Any], task_name: str) -> None:
    """Warn about attributes of a ``DedupTask`` class that look like misspelt options.

    Called when the task class is created (``@app.task(unique_untill=...)``
    sets ``unique_untill`` on it); names Celery's ``Task`` itself has are skipped.
    """
    from celery import Task

    for name in attributes:
        if not name.startswith("_") and not hasattr(Task, name):
            _warn_if_misspelt(name, TASK_OPTIONS, task_name, "task option")


def warn_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Warn about ``dedup_*`` settings celery-dedup does not read (a typo?)."""
    for name in list(conf.keys()):
        if isinstance(name, str) and name.lower().startswith("dedup"):
            _warn_if_misspelt(name, KNOWN_SETTINGS, "", "setting")


@contextmanager
def naming_task(task_name: str) -> Iterator[None]:
    """Prefix an ``InvalidOptionError`` raised inside with ``task_name``.

    So every option error says which task it is about, including the ones
    raised where a worker first resolves a task's options.
    """
    try:
        yield
    except InvalidOptionError as exc:
        if task_name and not exc.task_name:
            exc.name_task(task_name)
        raise


@dataclass(frozen=True)
class ResolvedOptions:
    """The options that apply to one call, after call > task > settings > default."""

    unique_for: float | None
    unique_until: UniqueUntil
    identity: Identity
    on_duplicate: OnDuplicate
    deterministic_id: bool
    deduplication_key: str | None
    #: what a ``deduplication_key`` held for different arguments does
    on_key_reuse: OnKeyReuse = OnKeyReuse.WARN
    #: ``replace`` only: a run happens at most this long after its burst's first call
    debounce_max_wait: float | None = None
    #: ``cancel_running`` only: seconds to wait for the cancelled holder to free the key
    cancel_wait: float = 10.0
    #: ``cancel_running`` only: the signal that terminates a running holder
    cancel_signal: str = "SIGUSR1"
    #: ``unique_until="success"`` only: seconds a failed run's key stays held
    retry_window: float | None = None
    #: ``observe``: every refusal is published anyway and counted
    mode: DedupMode = DedupMode.ENFORCE
