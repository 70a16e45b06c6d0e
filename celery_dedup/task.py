"""``DedupTask``: a Celery ``Task`` whose ``apply_async`` takes a TTL lock per call."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, cast

from celery import Celery, Task
from celery.app.routes import Router
from celery.utils import uuid

from . import admission, combinations, envelope, native, rates, worker
from .admission import Admission
from .exceptions import (
    FencingNotSupported,
    InvalidOptionError,
    MissingDeduplicationKey,
)
from .handoff import CALLED_FIELD
from .header import HEADER, NO_LOCK, LockHeader
from .identity import (
    ArgumentBinder,
    Identity,
    as_delivered,
    bound_queue,
    caller_key_material,
    deterministic_task_id,
    lock_key,
    new_task_id,
)
from .lifecycle import Held, Outcome
from .lint_calls import lint_first_call
from .options import (
    DedupMode,
    OnDuplicate,
    OnKeyReuse,
    ResolvedOptions,
    naming_task,
    pop_call_options,
    validate_bool,
    validate_choice,
    validate_key,
    validate_lint_ids,
    validate_max_wait,
    validate_signal,
    validate_unique_for,
    validate_wait,
    warn_unknown_task_options,
)
from .policy import KEEPS_ON_FAILURE, UniqueUntil
from .results import mark_result
from .runs import DELIVERY_FIELD, INHERITED_FIELD
from .runtime import Runtime, runtime_for
from .stores.base import issues_fences

__all__ = ["DedupTask"]

logger = logging.getLogger("celery_dedup")


def _validate_unique_on(value: Any, option: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidOptionError(option, value, "a parameter name or a sequence of names")
    return tuple(names)


def _validate_key_callable(value: Any, option: str) -> Any:
    if value is not None and not callable(value):
        raise InvalidOptionError(option, value, "a callable returning a string, or None")
    return value


#: task attribute → validator; ``None`` always means "ask the app".
_ATTRIBUTES: Mapping[str, Callable[[Any, str], Any]] = {
    "unique_for": validate_unique_for,
    "unique_until": lambda v, o: None if v is None else validate_choice(UniqueUntil, v, o),
    "identity": lambda v, o: None if v is None else validate_choice(Identity, v, o),
    "on_duplicate": lambda v, o: None if v is None else validate_choice(OnDuplicate, v, o),
    "deterministic_id": lambda v, o: None if v is None else validate_bool(v, o),
    "unique_on": _validate_unique_on,
    "deduplication_key": _validate_key_callable,
    "dedup_silenced": validate_lint_ids,
    "on_key_reuse": lambda v, o: None if v is None else validate_choice(OnKeyReuse, v, o),
    "debounce_max_wait": validate_max_wait,
    "cancel_wait": lambda v, o: None if v is None else validate_wait(v, o),
    "cancel_signal": lambda v, o: None if v is None else validate_signal(v, o),
    "retry_window": validate_max_wait,
    "fence": lambda v, o: None if v is None else validate_bool(v, o),
    "dedup_mode": lambda v, o: None if v is None else validate_choice(DedupMode, v, o),
}


#: Task options that may be functions of the call's arguments: Celery keeps
#: task options as class attributes, so each is kept as a ``staticmethod``.
_CALLABLE_ATTRIBUTES = (
    "deduplication_key",
    "concurrency_key",
    "rate_key",
    "concurrency_limit",
    "rate_limit_per_key",
)


@dataclass(frozen=True)
class TaskConfig:
    """A task's options after task attributes and app settings, resolved once."""

    runtime: Runtime
    unique_for: float
    unique_until: UniqueUntil
    identity: Identity
    on_duplicate: OnDuplicate
    deterministic_id: bool
    key_callable: Callable[..., Any] | None
    binder: ArgumentBinder
    #: the queue a call goes to when it names none (task ``queue`` or the app default)
    default_queue: str
    #: whether a call naming no queue must be routed (``task_routes`` applies)
    routed: bool = False
    #: the task's serializer: keys are computed on the arguments it delivers
    serializer: str = "json"
    #: what a caller's key held for different arguments does
    on_key_reuse: OnKeyReuse = OnKeyReuse.WARN
    #: ``replace``: the cap of a debounce (``debounce_max_wait``), or ``None``
    debounce_max_wait: float | None = None
    #: ``cancel_running``: seconds to wait for the key, and the terminating signal
    cancel_wait: float = 10.0
    cancel_signal: str = "SIGUSR1"
    #: ``unique_until="success"``: seconds a failed run's key stays held, or ``None``
    retry_window: float | None = None
    #: whether each admitted run gets a fencing token (``fence=True``)
    fence: bool = False
    #: ``"observe"``: refusals are published anyway and counted (``dedup_mode``)
    mode: DedupMode = DedupMode.ENFORCE

    def resolve(self, given: Mapping[str, Any]) -> ResolvedOptions:
        """Apply one call's options (already validated) over the task's."""
        if not given:
            return self.default_call
        return ResolvedOptions(
            unique_for=given.get("unique_for", self.unique_for),
            unique_until=given.get("unique_until", self.unique_until),
            identity=given.get("identity", self.identity),
            on_duplicate=given.get("on_duplicate", self.on_duplicate),
            deterministic_id=given.get("deterministic_id", self.deterministic_id),
            deduplication_key=given.get("deduplication_key"),
            on_key_reuse=given.get("on_key_reuse", self.on_key_reuse),
            debounce_max_wait=given.get("debounce_max_wait", self.debounce_max_wait),
            cancel_wait=given.get("cancel_wait", self.cancel_wait),
            cancel_signal=given.get("cancel_signal", self.cancel_signal),
            retry_window=given.get("retry_window", self.retry_window),
            mode=given.get("dedup_mode", self.mode),
        )

    @cached_property
    def default_call(self) -> ResolvedOptions:
        """The options of a call that passes none of its own (built once)."""
        return ResolvedOptions(
            unique_for=self.unique_for,
            unique_until=self.unique_until,
            identity=self.identity,
            on_duplicate=self.on_duplicate,
            deterministic_id=self.deterministic_id,
            deduplication_key=None,
            on_key_reuse=self.on_key_reuse,
            debounce_max_wait=self.debounce_max_wait,
            cancel_wait=self.cancel_wait,
            cancel_signal=self.cancel_signal,
            retry_window=self.retry_window,
            mode=self.mode,
        )


def _fencing(task_name: str, runtime: Runtime, fence: bool) -> bool:
    """``fence``, once the store is known to issue fences (else ``FencingNotSupported``)."""
    store = runtime.store if fence else None
    if store is not None and not issues_fences(store):
        raise FencingNotSupported(task_name, str(getattr(store, "name", type(store).__name__)))
    return fence


if TYPE_CHECKING:
    _Task = Task[..., Any]
else:
    _Task = Task


class DedupTask(_Task):
    """A task whose enqueueing is idempotent.

    Every call through ``apply_async`` (``delay``, signatures, chains, beat,
    Flower) takes a TTL lock keyed on the call's identity before it is
    published; a second call while the lock is held publishes nothing and
    returns the holder's result (or raises, or replaces it: ``on_duplicate``).
    """

    #: Seconds (int, float or ``timedelta``) a lock lives; ``None`` asks
    #: ``dedup_default_ttl``. Scheduled calls add their delay.
    unique_for: float | timedelta | None = None

    #: When the lock is released: ``"start"``, ``"success"``, ``"finish"`` or
    #: ``"expiry"``; ``None`` asks ``dedup_default_unique_until``.
    unique_until: UniqueUntil | str | None = None

    #: How calls are identified without a key: ``"strict"``,
    #: ``"caller_provided"`` or ``"always_unique"``; ``None`` asks the app.
    identity: Identity | str | None = None

    #: What a duplicate call does: ``"existing"``, ``"raise"``, ``"replace"`` or
    #: ``"keep_last"``.
    on_duplicate: OnDuplicate | str | None = None

    #: Parameter names the strict identity is restricted to.
    unique_on: Sequence[str] | str | None = None

    #: A callable taking the call's arguments and returning the key string.
    deduplication_key: Callable[..., str] | None = None

    #: Derive the task id from the lock key (uuid5), the same for every producer.
    deterministic_id: bool | None = None

    #: A call's ``deduplication_key`` held for different arguments: ``"raise"``
    #: (``KeyReuseError``), ``"warn"`` or ``"ignore"``; ``None`` asks
    #: ``dedup_on_key_reuse`` (default ``"warn"``).
    on_key_reuse: OnKeyReuse | str | None = None
    #: ``on_duplicate="replace"``: a run starts at most this many seconds after
    #: the first call of its burst, however long the calls keep coming.
    debounce_max_wait: float | timedelta | None = None

    #: ``on_duplicate="cancel_running"``: seconds a call waits for the cancelled
    #: holder to free the key; ``None`` asks ``dedup_cancel_wait``.
    cancel_wait: float | timedelta | None = None

    #: ``on_duplicate="cancel_running"``: the signal terminating a running
    #: holder; ``None`` asks ``dedup_cancel_signal`` (``"SIGUSR1"``).
    cancel_signal: str | None = None

    #: ``unique_until="success"``: seconds the key stays held after a **failed**
    #: run (a cooldown from the failure); a success holds it for the rest of
    #: ``unique_for``. ``None`` asks ``dedup_retry_window`` (``None``: a failure
    #: holds it for ``unique_for`` too).
    retry_window: float | timedelta | None = None

    #: Issue each admitted run of a key a fencing token, greater than every
    #: token of the key before it, in the start claim's round trip:
    #: ``celery_dedup.current_fence()`` in the body, ``celery_dedup.fence`` to make
    #: a side effect conditional on it. Redis, Redis Cluster, PostgreSQL and memory stores.
    fence: bool | None = None

    #: ``"observe"``: keys, locks and checks as usual, but a call that would be
    #: suppressed, refused by its rate, or would replace or cancel a holder is
    #: published anyway and counted (``would_*`` metrics, ``task_observed``);
    #: ``"enforce"`` applies them; ``None`` asks ``dedup_mode`` (``"enforce"``).
    dedup_mode: DedupMode | str | None = None

    #: Option names this class uses for something else (the celery-singleton
    #: shim's ``on_duplicate(existing_task_id)`` hook): they are neither
    #: validated nor read as options; the app's settings apply unless the
    #: subclass's ``build_dedup_config`` supplies them.
    dedup_not_options: frozenset[str] = frozenset()

    #: Settings-lint ids (``"W101"``…) not to report for this task
    #: (``celery_dedup.lint``); ``dedup_silenced_warnings`` silences them app-wide.
    dedup_silenced: Sequence[str] = ()

    _dedup_config: TaskConfig | None = None
    _dedup_generation: int = -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        task_name = str(cls.__dict__.get("name") or cls.__qualname__)
        if "run" in cls.__dict__:  # typo warnings are for tasks, not their bases
            inherited = {n for base in cls.__mro__[1:] for n in vars(base)}
            own = {n: v for n, v in cls.__dict__.items() if n not in inherited}
            warn_unknown_task_options(own, task_name)
        with naming_task(task_name):
            for name, validate in _ATTRIBUTES.items():
                if name in cls.__dict__ and name not in cls.dedup_not_options:
                    validate(cls.__dict__[name], name)
        if "run" in cls.__dict__:  # a task (a base's defaults may serve tasks without them)
            combinations.check_task(
                cls.__dict__,
                lambda name: getattr(cls, name, None),
                task_name,
                cls.dedup_not_options,
            )
        if cls.__dict__.get("unique_on") is not None and "run" in cls.__dict__:
            # Unknown parameter names fail at definition, not at the first call.
            ArgumentBinder(cls.run, task_name, _validate_unique_on(cls.unique_on, "unique_on"))
        if not envelope.is_wrapped(cls.__call__):
            # An override that skips ``super().__call__`` (Flask's FlaskTask)
            # must not run the body outside the start claim and release.
            cls.__call__ = envelope.wrap_call(cls.__call__)  # type: ignore[method-assign]
        for name in _CALLABLE_ATTRIBUTES:
            given = cls.__dict__.get(name)
            if callable(given) and not isinstance(given, staticmethod):
                # A function stored on the class would become a bound method.
                setattr(cls, name, staticmethod(given))

    # -- configuration -----------------------------------------------------

    def dedup_config(self) -> TaskConfig:
        """This task's resolved options (task attributes over app settings), cached.

        Rebuilt when the app's ``dedup_*`` settings changed since.
        """
        config = self._dedup_config
        if config is None or config.runtime.changed_since(self._dedup_generation):
            with naming_task(self.name):
                config = self._dedup_config = self.build_dedup_config()
            self._dedup_generation = config.runtime.generation
        return config

    def build_dedup_config(self) -> TaskConfig:
        """Resolve task attributes over app settings (called once per task).

        Override to derive options from elsewhere, e.g. another library's
        settings (the ``celery_dedup.compat`` shims do); return the result of
        ``dataclasses.replace(super().build_dedup_config(), ...)``.
        """
        runtime = runtime_for(self.app)
        settings = runtime.settings

        def attr(name: str) -> Any:
            return None if name in self.dedup_not_options else getattr(self, name)

        unique_for = validate_unique_for(attr("unique_for"))
        on_duplicate = _choice(OnDuplicate, attr("on_duplicate"), settings.default_on_duplicate)
        own = {
            name: value
            for name, value in type(self).__dict__.items()
            if name not in self.dedup_not_options
        }
        unique_until = _choice(UniqueUntil, attr("unique_until"), settings.default_unique_until)
        resolved = {"on_duplicate": on_duplicate, "unique_until": unique_until}
        combinations.check_resolved(own, resolved, self.name)
        ttl = unique_for if unique_for is not None else settings.default_ttl
        window = validate_max_wait(attr("retry_window"), "retry_window")
        combinations.check_window(window, ttl, self.name)
        if window is None and unique_until in KEEPS_ON_FAILURE:
            # The app-wide cooldown: for the tasks whose window it shortens.
            window = settings.retry_window if (settings.retry_window or ttl) < ttl else None
        return TaskConfig(
            runtime=runtime,
            unique_for=ttl,
            unique_until=unique_until,
            identity=_choice(Identity, attr("identity"), settings.default_identity),
            on_duplicate=on_duplicate,
            deterministic_id=bool(attr("deterministic_id")),
            key_callable=attr("deduplication_key"),
            binder=ArgumentBinder(self.run, self.name, _validate_unique_on(attr("unique_on"), "")),
            default_queue=str(
                getattr(self, "queue", None) or self.app.conf.task_default_queue or "celery"
            ),
            routed=bool(self.app.conf.task_routes) and not getattr(self, "queue", None),
            serializer=str(self.serializer or self.app.conf.task_serializer or "json"),
            on_key_reuse=_choice(OnKeyReuse, attr("on_key_reuse"), settings.on_key_reuse),
            debounce_max_wait=validate_max_wait(attr("debounce_max_wait")),
            cancel_wait=_or(attr("cancel_wait"), settings.cancel_wait, validate_wait),
            cancel_signal=_or(attr("cancel_signal"), settings.cancel_signal, validate_signal),
            retry_window=window,
            fence=_fencing(self.name, runtime, bool(attr("fence"))),
            mode=(
                settings.mode
                if attr("dedup_mode") is None
                else validate_choice(DedupMode, attr("dedup_mode"), "dedup_mode")
            ),
        )

    # -- keys --------------------------------------------------------------

    def dedup_key(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        call: ResolvedOptions,
        queue: Any = None,
        serializer: str | None = None,
    ) -> str | None:
        """The lock key of a call, or ``None`` when the call takes no lock.

        Computed on the arguments as ``serializer`` (default: the task's)
        delivers them and on ``queue``, the queue the call is routed to
        (see ``routed_queue``), so every path computes the same key.
        """
        return self._key(self.dedup_config(), args, kwargs, call, queue, serializer)

    def _key(
        self,
        config: TaskConfig,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        call: ResolvedOptions,
        queue: Any,
        serializer: str | None,
    ) -> str | None:
        """``dedup_key`` with the task's options already resolved."""
        prefix = config.runtime.settings.key_prefix
        queue_name = getattr(queue, "name", queue) or config.default_queue
        if (
            not kwargs
            and call.deduplication_key is None
            and call.identity is Identity.STRICT
            and config.key_callable is None
            and (serializer or config.serializer) == "json"
        ):
            material = config.binder.positional_identity(queue_name, args or ())
            if material is not None:  # plain scalars: JSON delivers them unchanged
                return lock_key(prefix, self.name, material)
        try:
            args, kwargs = as_delivered(args, kwargs, serializer or config.serializer)
        except Exception:
            # Name the offending argument when the canonical form can (a set,
            # an object); otherwise fail as publishing it would.
            config.binder.identity(None, args, kwargs)
            raise
        caller_key = call.deduplication_key
        if caller_key is None and config.key_callable is not None:
            caller_key = validate_key(config.key_callable(*args, **kwargs), "deduplication_key")
        if caller_key is not None:
            return lock_key(prefix, self.name, caller_key_material(caller_key))
        if call.identity is Identity.CALLER_PROVIDED:
            raise MissingDeduplicationKey(task_name=self.name)
        if call.identity is Identity.ALWAYS_UNIQUE:
            return None
        return lock_key(prefix, self.name, config.binder.identity(queue_name, args, kwargs))

    def routed_queue(
        self,
        options: Mapping[str, Any],
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> str:
        """The name of the queue a call is published to, as ``send_task`` routes it.

        An explicit ``queue`` wins, then the task's own ``queue``, then
        ``task_routes`` (routers may look at the arguments), then
        ``task_default_queue``.
        """
        return self._route(options, args, kwargs)[0]

    def _route(
        self,
        options: Mapping[str, Any],
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        config: TaskConfig | None = None,
    ) -> tuple[str, _Routed | None]:
        """The routed queue's name, and the router answering this call when the routers ran.

        The routers are asked once, with the options ``send_task`` would
        hand them; ``send_task`` then gets a router that answers with that
        route and merges the call's options over it as Celery's router does.
        """
        queue = options.get("queue")
        if queue is not None:
            return str(getattr(queue, "name", queue)), None
        config = config or self.dedup_config()
        if not config.routed:
            return config.default_queue, None
        app_router: Any = self.app.amqp.router
        asked = _router_options(self, options)
        route = app_router.lookup_route(
            self.name,
            tuple(args or ()),
            dict(kwargs or {}),
            app_router.expand_destination(dict(asked)),
            self,
        )
        router = _Routed(app_router, route)
        routed: Mapping[str, Any] = cast(Any, router).route(
            asked, self.name, tuple(args or ()), dict(kwargs or {}), self
        )
        return destination_name(self.app, routed) or config.default_queue, router

    # -- enqueue -----------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Take the call's lock, then publish; or return/raise for a duplicate.

        Accepts, besides Celery's options: ``deduplication_key``,
        ``unique_for`` (``None``/``0`` publishes with no lock at all),
        ``unique_until``, ``on_duplicate``, ``identity`` and ``deterministic_id``.
        """
        prepared = self.prepare_call(
            args, kwargs, task_id, producer, link, link_error, shadow, options
        )
        if isinstance(prepared, Admission):
            return admission.admit(prepared)
        return prepared()

    def prepare_call(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        producer: Any,
        link: Any,
        link_error: Any,
        shadow: str | None,
        options: dict[str, Any],
    ) -> Admission | Callable[[], Any]:
        """Resolve a call (options, route, key): nothing written, nothing published.

        Returns the call's ``Admission`` when it takes a lock in the store
        (``admission.admit`` admits it), else what finishes the call another
        way (no lock, native deduplication, a holder's own republish).
        ``enqueue_many(per_item=True)`` admits many prepared calls at once.
        """
        given = pop_call_options(options, self.name) if options else {}
        config = self.dedup_config()
        if self.name not in config.runtime.linted:
            lint_first_call(self, config.runtime)

        def publish(task_id: str, header: LockHeader) -> Any:
            headers = {**(options.get("headers") or {}), HEADER: header.encode()}
            # A retry or replace copies the running request's headers: the
            # worker's delivery token belongs to that delivery only.
            headers.pop(DELIVERY_FIELD, None)
            headers.pop(INHERITED_FIELD, None)
            # The call's place in a full concurrency key's wait list (kept by a retry).
            headers.setdefault(CALLED_FIELD, time.time())
            options["headers"] = headers
            return super(DedupTask, self).apply_async(
                cast(Any, args),
                cast(Any, kwargs),
                task_id,
                producer,
                link,
                link_error,
                shadow,
                **options,
            )

        if self._is_holder_republish(task_id, options):
            held_id = task_id
            assert held_id is not None
            return lambda: worker.republish_as_holder(self, held_id, options, publish)
        if given.get("unique_for", ...) is None:
            return lambda: mark_result(publish(task_id or uuid(), NO_LOCK), None)
        call = config.resolve(given)
        if given:
            resolved = {"on_duplicate": call.on_duplicate, "unique_until": call.unique_until}
            combinations.check_call(given, resolved, self.name)
            if "retry_window" in given:
                combinations.check_window(call.retry_window, call.unique_for, self.name)
            elif (call.retry_window or 0) >= (call.unique_for or 0) > 0:
                # A call's shorter unique_for already ends a failure's hold sooner.
                call = replace(call, retry_window=None)
        # Routers and keys see the arguments as Celery sends them (pydantic models dumped).
        sent_args, sent_kwargs = self._as_sent(args, kwargs, options)
        queue_name, router = self._route(options, sent_args, sent_kwargs, config)
        if router is not None:
            # send_task would run the routers again (a router may not be pure).
            options["router"] = router
        serializer = options.get("serializer")
        if type(self).dedup_key is DedupTask.dedup_key:
            key = self._key(config, sent_args, sent_kwargs, call, queue_name, serializer)
        else:  # a subclass's own key (the compat shims)
            key = self.dedup_key(sent_args, sent_kwargs, call, queue_name, serializer)
        if key is None:
            unlocked = Admission(self, config, call, None, task_id or uuid(), sent_args,
                                 sent_kwargs, options, publish)  # fmt: skip
            return lambda: admission.admit_unlocked(unlocked)
        settings = config.runtime.settings
        # Observed, the store decides and counts: the broker would drop a duplicate unseen.
        observed = call.mode is DedupMode.OBSERVE
        if not observed and native.uses_native(settings.native, settings.broker_scheme, queue_name):
            rates.refuse_native(self)  # the broker deduplicates: no store counts the rate
            native_key = key
            return lambda: self._publish_native(
                call, native_key, queue_name, task_id, options, publish
            )
        if task_id is None:
            task_id = deterministic_task_id(key) if call.deterministic_id else new_task_id()
        return Admission(self, config, call, key, task_id, sent_args, sent_kwargs, options,
                         publish, store=config.runtime.store)  # fmt: skip

    def _as_sent(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> tuple[Sequence[Any] | None, Mapping[str, Any] | None]:
        """The arguments ``Task.apply_async`` publishes: ``pydantic=True`` tasks dump models."""
        dump = cast(Any, self)._dump_pydantic_arguments
        if dump is None or (options.get("serializer") or self.serializer) == "pickle":
            return args, kwargs
        dumped: tuple[Sequence[Any] | None, Mapping[str, Any] | None] = dump(args, kwargs)
        return dumped

    def _publish_native(
        self,
        call: ResolvedOptions,
        key: str,
        queue_name: str,
        task_id: str | None,
        options: dict[str, Any],
        publish: Callable[[str, LockHeader], Any],
    ) -> Any:
        """Let the broker drop duplicates (SQS FIFO): no store, a key-derived task id.

        A canvas call (a group or chord member, a chain step) keeps kombu's
        random deduplication id: SQS drops a duplicate without telling
        anyone, which would cut the canvas (a chord that never runs its
        body, a chain that never starts) where the store mode publishes
        it anyway or raises.
        """
        assert call.unique_for is not None
        if options.get("group_id") or options.get("chord") or options.get("chain") is not None:
            return mark_result(publish(task_id or uuid(), NO_LOCK), key)
        native.warn_unhonoured(
            self.name,
            queue_name,
            call.unique_for,
            call.unique_until.value,
            call.on_duplicate.value,
        )
        native.set_native_options(options, key)
        result = mark_result(publish(task_id or deterministic_task_id(key), NO_LOCK), key)
        result.deduplicated = None  # only the broker knows
        return result

    def delay(self, *args: Any, **kwargs: Any) -> Any:
        """Star-argument shortcut for ``apply_async``; may return a ``DeduplicatedResult``."""
        return self.apply_async(args, kwargs)

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """Django: ``delay`` once the current transaction commits (nothing on rollback).

        Celery's ``DjangoTask.delay_on_commit``, which ``base=DedupTask``
        would otherwise lose: the lock is taken and the message published
        only on commit, so a rolled-back request leaves neither. Calls with
        the same lock key in one transaction publish once
        (``celery_dedup.contrib.django.on_commit``). Returns ``None``.
        """
        from .contrib.django.on_commit import on_commit

        on_commit(self, args, kwargs, {})

    def apply_async_on_commit(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        *,
        using: str | None = None,
        **options: Any,
    ) -> None:
        """Django: ``apply_async`` once the transaction commits, folded as ``delay_on_commit``.

        ``using``: the database whose transaction to wait for (default: the default one).
        """
        from .contrib.django.on_commit import on_commit

        if task_id is not None:
            options["task_id"] = task_id
        on_commit(self, args, kwargs, options, using)

    def _is_holder_republish(self, task_id: str | None, options: Mapping[str, Any]) -> bool:
        """A ``retry()`` or ``replace()`` from inside the holder's own execution."""
        if task_id is None or not (options.get("retries") or options.get("replaced_task_nesting")):
            return False
        current = self.app.current_worker_task
        return current is not None and current.request.id == task_id

    # -- worker-side hooks -------------------------------------------------

    #: The worker's request class: it guards a message without the header and
    #: releases on a hard time limit (a subclass of it keeps both; any other
    #: class gets them from a ``task_received`` receiver instead).
    Request = "celery_dedup.worker:DedupRequest"

    def start_strategy(self, app: Any, consumer: Any, **kwargs: Any) -> Any:
        """The worker builds this task's message handler: check its ``Request`` class."""
        worker.prepare_strategy(self)
        return super().start_strategy(app, consumer, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body inside the worker's envelope (``celery_dedup.envelope``).

        The tracer stores SUCCESS/FAILURE only after this returns, so a
        ``result.get()`` that returns means the lock is already released. A
        subclass's own ``__call__`` is wrapped the same way (``__init_subclass__``).
        """
        return envelope.run(self, super().__call__, args, kwargs)

    setattr(__call__, envelope.MARK, True)

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """A hard time limit seen by a ``task_received`` receiver: release from the main process.

        Only for a ``Request`` class of the task's own; ``DedupRequest``
        releases by itself, before the failure is stored.
        """
        if self.request.id != task_id:
            worker.release_from_main_process(self, task_id, args, kwargs, Outcome.FAILURE)
        super().on_failure(exc, task_id, args, kwargs, einfo)

    def on_replace(self, sig: Any) -> Any:
        """``self.replace(sig)``: the lock passes to a single ``DedupTask`` replacement.

        The replacement is published with this run's header and owner token,
        so its own claim and release apply the original policy. Any other
        replacement (a plain task, a chain, a group) ends this run's hold:
        the lock is released as on success.
        """
        held: Held | None = getattr(self.request, "dedup_held", None)
        if held is not None and not self.request.is_eager and _takes_over_lock(self, sig):
            headers = dict(sig.options.get("headers") or {})
            headers[HEADER] = held.header.encode()
            sig.set(headers=headers)
            held.handed_over = True
        return super().on_replace(sig)

    def dedup_header(self, task_id: str) -> LockHeader | None:
        """The ``celery_dedup`` header of the running request ``task_id``."""
        request = self.request
        if request.id == task_id:
            return worker.header_of(request)
        return worker.header_from_main_process(task_id)


def _or(value: Any, default: Any, validate: Callable[[Any, str], Any]) -> Any:
    return default if value is None else validate(value, "")


def _choice(enum: Any, value: Any, default: Any) -> Any:
    return default if value is None else validate_choice(enum, value, "")


class _Routed(Router):
    """The app's router, answering with a route already looked up for this call.

    Everything else is Celery's ``Router.route``: the options ``send_task``
    hands it are merged over the route exactly as without celery-dedup.
    """

    def __init__(self, router: Any, route: Any) -> None:
        super().__init__([route], router.queues, router.create_missing, router.app)
        self.found = route

    def lookup_route(self, *_: Any, **__: Any) -> Any:
        # Router.expand_destination pops "queue" from the route: hand out a copy.
        return dict(self.found) if isinstance(self.found, Mapping) else self.found


#: ``send_task``'s own parameters: never in the options its routers see.
_SEND_TASK_PARAMETERS: Final = frozenset(inspect.signature(Celery.send_task).parameters) - {
    "options"
}


def _router_options(task: DedupTask, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options ``Task.apply_async`` → ``send_task`` hands the routers for this call."""
    merged = dict(cast(Any, task)._get_exec_options(), **options)
    return {
        name: value
        for name, value in merged.items()
        if name not in _SEND_TASK_PARAMETERS and name != "ignore_result"
    }


def destination_name(app: Any, routed: Mapping[str, Any]) -> str | None:
    """The queue name a routed call's key uses, as the worker finds it from delivery info.

    A route naming a queue gives its name; a route with only an exchange
    and a routing key gives the app queue bound to that pair (as the
    worker looks it up), else the routing key.
    """
    target = routed.get("queue")
    exchange, routing_key = routed.get("exchange"), routed.get("routing_key")
    exchange = getattr(exchange, "name", exchange)
    if target is None and exchange and routing_key:
        bound = bound_queue(app.amqp.queues.values(), str(exchange), str(routing_key))
        if bound is not None:
            return bound
    name = getattr(target, "name", target) or routing_key
    return str(name) if name else None


def _takes_over_lock(task: DedupTask, sig: Any) -> bool:
    """Whether ``sig`` is one task of this app that takes a ``celery_dedup`` header."""
    from celery.canvas import Signature, _chain, group

    if not isinstance(sig, Signature) or isinstance(sig, (_chain, group)):
        return False
    target = task.app.tasks.get(str(sig.task))
    return target is not None and hasattr(target, "dedup_config")
