"""The one list of celery-dedup's options and settings.

Every name a user can write (a call option, a task attribute, an app
setting), where it is accepted, what it takes and what it does, in one
place. The "did you mean" list of misspelt names (``options``), the
reference tables of the docs (``render_option_table``,
``render_setting_table``, between ``<!-- options:… -->`` markers) and the
checks that the validators cover every name (a test) come from here, so
they cannot drift. Pure data: this module imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "CALL_NAMES",
    "OPTIONS",
    "REQUIRES",
    "SETTINGS",
    "SETTING_NAMES",
    "TASK_NAMES",
    "Option",
    "Setting",
    "fill_tables",
    "render_django_table",
    "render_option_table",
    "render_requires_table",
    "render_setting_table",
]


@dataclass(frozen=True)
class Option:
    """A per-call and/or task option."""

    name: str
    #: accepted by ``apply_async``/``sig.set`` (text: what the call takes, if it differs)
    call: bool
    #: accepted as a task attribute (``@app.task(name=…)`` or a subclass)
    task: bool
    #: the values it takes (Markdown)
    values: str
    #: what it does (Markdown, one line)
    doc: str
    #: how the call column reads when the call takes something else than the task
    call_note: str = ""
    task_note: str = ""
    #: the option this one only works with, and the value it must have ("": any, set;
    #: "a|b": either)
    requires: tuple[str, str] | None = None


@dataclass(frozen=True)
class Setting:
    """An app setting (``app.conf``; ``CELERY_…`` under Django)."""

    name: str
    #: its default (Markdown)
    default: str
    #: what it does (Markdown, one line)
    doc: str

    @property
    def django(self) -> str:
        """The name under Django's ``namespace="CELERY"``."""
        return f"CELERY_{self.name.upper()}"


OPTIONS: Final[tuple[Option, ...]] = (
    Option("unique_for", True, True, "seconds (`int`, `float`, `timedelta`) > 0",
           "lock lifetime; default `dedup_default_ttl`. Per call, `None` or `0` publishes "
           "**with no lock at all** (bypass)"),
    Option("unique_until", True, True,
           '`"start"`, `"success"`, `"finish"`, `"expiry"` (`UniqueUntil`)',
           "when the lock is released early ([lock lifetime]"
           "(usage.md#lock-lifetime-unique_for-and-unique_until))"),
    Option("retry_window", True, True, "seconds > 0, shorter than `unique_for`, or `None`",
           '`"success"` and `"expiry"` only: after a **failed** run the key stays held only '
           "this long (a cooldown from the failure); a success follows the policy "
           '(`"expiry"`: held for the rest of `unique_for`); `None`: a failure holds it for '
           "`unique_for`; default `dedup_retry_window` ([a window per outcome]"
           "(usage.md#a-window-per-outcome-retry_window))",
           requires=("unique_until", "success|expiry")),
    Option("identity", True, True,
           '`"strict"`, `"caller_provided"`, `"always_unique"` (`Identity`)',
           "how a call's identity is derived without a key"),
    Option("on_duplicate", True, True,
           '`"existing"`, `"raise"`, `"replace"`, `"keep_last"`, `"cancel_running"` '
           "(`OnDuplicate`)",
           "what a duplicate call does"),
    Option("dedup_mode", True, True, '`"enforce"`, `"observe"` (`DedupMode`)',
           '`"observe"`: keys, locks and checks as usual, but a call that would be suppressed, '
           "rate-limited, or would replace or cancel another is **published anyway** and "
           "counted (`would_*` counters, `task_observed`, `task-observed`); default "
           "`dedup_mode` ([Observe-only rollout](rollout.md))"),
    Option("debounce_max_wait", True, True, "seconds > 0 or `None`",
           '`"replace"` only: a run starts at most this long after its burst\'s first call '
           "([cap](cancel_and_debounce.md#debounce_max_wait-a-debounce-that-still-runs))",
           requires=("on_duplicate", "replace")),
    Option("cancel_wait", True, True, "seconds from 0 to 3600",
           '`"cancel_running"` only: how long a call waits for the cancelled holder to free '
           "the key; default `dedup_cancel_wait`",
           requires=("on_duplicate", "cancel_running")),
    Option("cancel_signal", True, True, 'a signal name (`"SIGUSR1"`, `"SIGTERM"`…)',
           '`"cancel_running"` only: the signal terminating a running holder; default '
           "`dedup_cancel_signal`",
           requires=("on_duplicate", "cancel_running")),
    Option("deduplication_key", True, True,
           "a non-empty `str`; the task attribute is a function called with the call's "
           '`*args, **kwargs` returning a `str` (or `None` for "use the identity strategy")',
           "the caller's own key; always wins over the identity strategy",
           call_note="(a string)", task_note="(a callable)"),
    Option("deterministic_id", True, True, "`True` / `False`",
           "derive the task id from the lock key"),
    Option("on_key_reuse", True, True, '`"raise"`, `"warn"`, `"ignore"` (`OnKeyReuse`)',
           "a call's `deduplication_key` held by a publish with different arguments; default "
           "`dedup_on_key_reuse`. See [Key reuse](key_reuse.md)"),
    Option("fence", False, True, "`True` / `False`",
           "each admitted run of a key gets a fencing token greater than every earlier "
           "run's (`current_fence()`), for writes a stale run cannot overwrite; Redis, "
           "Redis Cluster, PostgreSQL and memory stores ([Protect the side effect](fencing.md))"),
    Option("unique_on", False, True, "a parameter name or a sequence of names",
           "restrict the strict identity to these parameters"),
    Option("dedup_silenced", False, True,
           'a sequence of [settings-lint](lint.md) ids (`("W101",)`)',
           "do not report these lint findings for this task"),
    Option("concurrency_limit", False, True,
           "an `int` >= 1, a callable of the call's arguments returning one, or `None`",
           "at most this many bodies of one `concurrency_key` run at once across every "
           "worker; a message over it is deferred. See [Per-key limits](limits.md)"),
    Option("concurrency_key", False, True,
           'a template over the arguments (`"{user}"`), a callable, or `None`',
           "the key `concurrency_limit` counts per; `None`: the deduplication key",
           requires=("concurrency_limit", "")),
    Option("concurrency_backoff", False, True, "seconds > 0 or `None`",
           "the countdown of a message deferred by `concurrency_limit` (with the "
           "[handoff](limits.md#handoff-a-freed-slot-goes-to-the-oldest-waiting-message), "
           "the safety net), and how long a slot reserved for a woken message waits for it; "
           "`None`: a third of `dedup_lease_ttl`, jittered",
           requires=("concurrency_limit", "")),
    Option("rate_limit_per_key", False, True,
           '`"N/s"`, `"N/m"`, `"N/h"`, `"N/d"` (N >= 1), a callable of the call\'s '
           "arguments returning one, or `None`",
           "at most N publishes of one `rate_key` per sliding period. See "
           "[Per-key limits](limits.md)"),
    Option("rate_key", False, True,
           'a template over the arguments (`"{user}"`), a callable, or `None`',
           "the key `rate_limit_per_key` counts per; `None`: the deduplication key",
           requires=("rate_limit_per_key", "")),
    Option("on_rate_limit", False, True,
           '`"raise"`, `"delay"`, `"last_publish"`, `"duplicate"` (`OnRateLimit`)',
           "a call over `rate_limit_per_key`: raises `RateLimited` (default; "
           '`"duplicate"` is its 0.3 name), is published with a countdown to its place '
           "in the window, or returns the last admitted publish's handle",
           requires=("rate_limit_per_key", "")),
)

SETTINGS: Final[tuple[Setting, ...]] = (
    Setting("dedup_store", "`None`: derived from `result_backend`, then the broker",
            "lock store URL: `redis://`, `rediss://`, `sentinel://`, `redis+cluster://`, "
            "`db+postgresql://…`, `db+mysql://…`, `db+sqlite:///…`, `django-db`, "
            "`django-cache[://alias]`, `memcached://host:port`, `memory://[name]`. See "
            "[Lock stores](stores/index.md)"),
    Setting("dedup_store_options", "`{}`",
            "keyword arguments for the store's client (driver specific)"),
    Setting("dedup_key_prefix", '`"celery-dedup"`',
            "first part of every key; non-empty, no whitespace"),
    Setting("dedup_default_ttl", "`3600`", "seconds a lock lives when no `unique_for` is given"),
    Setting("dedup_default_unique_until", '`"success"`',
            "see [lock lifetime](#lock-lifetime-unique_for-and-unique_until)"),
    Setting("dedup_retry_window", "`None`",
            '`unique_until="success"` or `"expiry"`: seconds a key stays held after a failed '
            "run (a cooldown); tasks under another policy, or whose `unique_for` is not "
            "longer, ignore it. See [a window per outcome]"
            "(usage.md#a-window-per-outcome-retry_window)"),
    Setting("dedup_mode", '`"enforce"`',
            '`"observe"` publishes every call a check would refuse and counts it instead; '
            "switching to `\"enforce\"` is this one setting. See "
            "[Observe-only rollout](rollout.md)"),
    Setting("dedup_default_identity", '`"strict"`',
            "see [identity](#identity-which-calls-are-the-same)"),
    Setting("dedup_default_on_duplicate", '`"existing"`',
            "see [duplicates](#duplicates-on_duplicate)"),
    Setting("dedup_on_key_reuse", '`"warn"`',
            "what a call does whose `deduplication_key` is held by a publish with different "
            'arguments: `"raise"` (`KeyReuseError`), `"warn"` (`KeyReuseWarning`, then a '
            'duplicate) or `"ignore"`. See [Key reuse](key_reuse.md)'),
    Setting("dedup_fallback",
            'not set: `"open"` for an unreachable store; **no store at all is an error**',
            '`"open"` publishes without a lock, `"closed"` raises `DeduplicationUnavailable`. '
            'Setting it to `"open"` explicitly is how an app without any lock store opts into '
            "publishing without deduplication. See [Fallback](fallback.md)"),
    Setting("dedup_send_events", "`None`: follows `task_send_sent_event`",
            "send `task-deduplicated`, `task-replaced` and `task-cancelled` events (Flower). "
            "See [Observability](observability.md)"),
    Setting("dedup_metrics_flush_interval", "`5`",
            "seconds between two flushes of the in-process counters to the store (`0` flushes "
            "on every count)"),
    Setting("dedup_native", '`"auto"`',
            '`"auto"` hands deduplication to a broker queue that does it itself (SQS FIFO) '
            'instead of the store; `"never"` always uses the store. See '
            "[Native deduplication](native.md)"),
    Setting("dedup_revoked_ttl", "`86400`",
            "seconds a revoked owner token stays refused at start (at least the lock's own "
            "TTL): a message revoked through `celery_dedup.revoke()` or replaced by "
            '`on_duplicate="replace"` that reaches a worker later than this runs if its key '
            "is free"),
    Setting("dedup_cancel_wait", "`10`",
            '`on_duplicate="cancel_running"`: seconds a call waits for the cancelled holder '
            "to free the key before raising `CancelTimeout` "
            "([cancel](cancel_and_debounce.md))"),
    Setting("dedup_cancel_signal", '`"SIGUSR1"`',
            '`on_duplicate="cancel_running"`: the signal terminating a running holder '
            "(`SIGUSR1`: `SoftTimeLimitExceeded` in a prefork pool)"),
    Setting("dedup_lease_ttl", "`60`",
            "seconds a started message's running lease lives unrenewed; the worker's main "
            "process renews the leases of its running messages every third of it. A "
            "redelivered copy of a running message waits (is deferred) while the lease is "
            "live; after a crash of the whole worker, its copy runs at most this long after "
            "the crash ([guarantees](guarantees.md#one-publish-one-run))"),
    Setting("dedup_done_ttl", "`None`",
            "seconds a completed run's done marker refuses late copies of its message; "
            "`None`: `unique_for` plus the broker's `visibility_timeout` (kombu's one hour on "
            "Redis and SQS unless `broker_transport_options` says otherwise; 0 on brokers "
            "that do not redeliver on a timer); never less than the lease nor than the "
            "life of a copy the worker parked (the longest deferral countdown, 60 s or "
            "within the `visibility_timeout`, plus as long again, at least 5 s)"),
    Setting("dedup_silenced_warnings", "`()`",
            "[settings-lint](lint.md) ids not to report for any task (`[\"W101\"]`; "
            '`"celery_dedup.W101"` works too); a task\'s own `dedup_silenced=("W101",)` '
            "silences them for that task"),
)

#: the names ``apply_async``/``sig.set`` accept
CALL_NAMES: Final = tuple(option.name for option in OPTIONS if option.call)
#: the task attributes ``DedupTask`` reads
TASK_NAMES: Final = tuple(option.name for option in OPTIONS if option.task)
#: every ``dedup_*`` setting celery-dedup reads
SETTING_NAMES: Final = tuple(setting.name for setting in SETTINGS)
#: option → (the option it only works with, the value that one must have; "": set)
REQUIRES: Final = {option.name: option.requires for option in OPTIONS if option.requires}


def _mark(accepted: bool, note: str) -> str:
    return f"✓ {note}".strip() if accepted else ""


def render_option_table() -> str:
    """The Markdown table of every call and task option."""
    lines = ["| option | call | task | values | |", "|---|---|---|---|---|"]
    for option in OPTIONS:
        lines.append(
            f"| `{option.name}` | {_mark(option.call, option.call_note)} "
            f"| {_mark(option.task, option.task_note)} | {option.values} | {option.doc} |"
        )
    return "\n".join(lines)


def render_requires_table() -> str:
    """The Markdown table of the options that only work with another one."""
    lines = ["| option | only with | otherwise |", "|---|---|---|"]
    for option in OPTIONS:
        if option.requires is None:
            continue
        needed, value = option.requires
        needs = (
            " or ".join(f'`{needed}="{v}"`' for v in value.split("|")) if value else f"`{needed}`"
        )
        lines.append(f"| `{option.name}` | {needs} | `OptionCombinationError` |")
    return "\n".join(lines)


def render_setting_table() -> str:
    """The Markdown table of every ``dedup_*`` setting."""
    lines = [
        '| setting (`app.conf`) | Django (`namespace="CELERY"`) | default | meaning |',
        "|---|---|---|---|",
    ]
    for setting in SETTINGS:
        lines.append(
            f"| `{setting.name}` | `{setting.django}` | {setting.default} | {setting.doc} |"
        )
    return "\n".join(lines)


def render_django_table() -> str:
    """The Markdown table of every setting's Django name."""
    lines = ["| Django setting | Celery setting |", "|---|---|"]
    lines += [f"| `{setting.django}` | `{setting.name}` |" for setting in SETTINGS]
    return "\n".join(lines)


#: marker name → the table rendered between ``<!-- options:NAME -->`` and ``<!-- /options:NAME -->``
_TABLES: Final = {
    "options": render_option_table,
    "settings": render_setting_table,
    "django": render_django_table,
    "requires": render_requires_table,
}


def fill_tables(text: str) -> str:
    """``text`` (a docs page) with every marked table rendered anew from the registry."""
    import re

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        return f"<!-- options:{name} -->\n{_TABLES[name]()}\n<!-- /options:{name} -->"

    pattern = r"<!-- options:(\w+) -->\n.*?<!-- /options:\1 -->"
    return re.sub(pattern, fill, text, flags=re.DOTALL)
