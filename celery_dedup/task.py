"""``DedupTask``: a Celery ``Task`` whose ``apply_async`` takes a TTL lock per call."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, cast

from celery import Celery, Task
from celery.app.routes import Router
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from . import cancel, coalesce, debounce, events, key_reuse, native, rates, slots, worker
from .exceptions import (
    DeduplicationUnavailable,
    DuplicateTaskError,
    InvalidOptionError,
    MissingDeduplicationKey,
    StoreContention,
    StoreError,
)
from .header import HEADER, NO_LOCK, LockHeader, new_token
from .identity import (
    ArgumentBinder,
    Identity,
    as_delivered,
    bound_queue,
    caller_key_material,
    deterministic_task_id,
    lock_key,
)
from .lifecycle import Held, Outcome, meta_for
from .lint_calls import lint_call_delay, lint_first_call
from .options import (
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
from .policy import UniqueUntil, lock_ttl
from .results import DeduplicatedResult, mark_result
from .runs import DELIVERY_FIELD, INHERITED_FIELD
from .runtime import Runtime, runtime_for
from .signals import lock_acquired, lock_replaced, task_deduplicated
from .stores.base import Lock, LockStore, replace_holder

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
}


#: Task options that may be functions of the call's arguments: Celery keeps
#: task options as class attributes, so each is kept as a ``staticmethod``.
_CALLABLE_ATTRIBUTES = ("deduplication_key", "concurrency_key", "rate_key")


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
        )


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
        if cls.__dict__.get("unique_on") is not None and "run" in cls.__dict__:
            # Unknown parameter names fail at definition, not at the first call.
            ArgumentBinder(cls.run, task_name, _validate_unique_on(cls.unique_on, "unique_on"))
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
        return TaskConfig(
            runtime=runtime,
            unique_for=unique_for if unique_for is not None else settings.default_ttl,
            unique_until=_choice(UniqueUntil, attr("unique_until"), settings.default_unique_until),
            identity=_choice(Identity, attr("identity"), settings.default_identity),
            on_duplicate=_choice(OnDuplicate, attr("on_duplicate"), settings.default_on_duplicate),
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
        given = pop_call_options(options, self.name) if options else {}
        config = self.dedup_config()
        if self.name not in config.runtime.linted:
            lint_first_call(self, config.runtime)
        if config.runtime.settings.visibility_timeout and (
            options.get("countdown") or options.get("eta")
        ):
            lint_call_delay(self, config.runtime, options)

        def publish(task_id: str, header: LockHeader) -> Any:
            headers = {**(options.get("headers") or {}), HEADER: header.encode()}
            # A retry or replace copies the running request's headers: the
            # worker's delivery token belongs to that delivery only.
            headers.pop(DELIVERY_FIELD, None)
            headers.pop(INHERITED_FIELD, None)
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
            assert task_id is not None
            return worker.republish_as_holder(self, task_id, options, publish)
        if given.get("unique_for", ...) is None:
            return mark_result(publish(task_id or uuid(), NO_LOCK), None)
        call = config.resolve(given)
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
            task_id = task_id or uuid()
            refused = rates.admit_unlocked(
                self, call.on_duplicate, task_id, sent_args, sent_kwargs, options
            )
            if refused is not None:
                return refused
            return mark_result(publish(task_id, NO_LOCK), None)
        settings = config.runtime.settings
        if native.uses_native(settings.native, settings.broker_scheme, queue_name):
            rates.refuse_native(self)  # the broker deduplicates: no store counts the rate
            return self._publish_native(call, key, queue_name, task_id, options, publish)
        if task_id is None:
            task_id = deterministic_task_id(key) if call.deterministic_id else uuid()
        return self._publish_with_lock(config, call, key, task_id, args, kwargs, options, publish)

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
        if (
            options.get("group_id")
            or options.get("chord")
            or options.get("chain") is not None
        ):
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

    def _publish_with_lock(
        self,
        config: TaskConfig,
        call: ResolvedOptions,
        key: str,
        task_id: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        publish: Callable[[str, LockHeader], Any],
    ) -> Any:
        """Take the lock (or take it over), then publish; or report the duplicate."""
        runtime = config.runtime
        assert call.unique_for is not None
        ttl = lock_ttl(call.unique_for, countdown=options.get("countdown"), eta=options.get("eta"))
        canvas_key = call.deduplication_key is not None and _is_canvas(options)
        # A canvas has no single end its lock could be released at: a key
        # given to a chain or a group holds the canvas as one unit for unique_for.
        until = UniqueUntil.EXPIRY if canvas_key else call.unique_until
        keep_last = call.on_duplicate is OnDuplicate.KEEP_LAST
        replaces = keep_last or call.on_duplicate is OnDuplicate.REPLACE
        cancels = call.on_duplicate is OnDuplicate.CANCEL_RUNNING and not cancel.in_canvas(options)
        # A message a newer call may take the key from waits for that call's
        # publish when it finds its lock gone (it may be given back).
        takes_over = replaces or cancels
        max_wait = call.debounce_max_wait if call.on_duplicate is OnDuplicate.REPLACE else None
        now = time.time()
        owner = (
            self._owner_token(config, call, args, kwargs, options)
            if max_wait is None
            # A replacing call is never judged for key reuse: the latest arguments win.
            else debounce.guess_owner(key, max_wait, now)
        )
        holder_id = str(options.get("group_id") or task_id) if canvas_key else task_id
        meta = meta_for(self, holder_id, until)
        previous: Lock | None = None
        cancelled: Lock | None = None
        holder: Lock | None = None
        capped = False
        try:
            store = runtime.store
            if store is None:
                return self._publish_unlocked(None, key, task_id, publish)
            if replaces:
                previous = self._take_over(store, key, owner, ttl, meta)
                if max_wait is not None:
                    owner, start = debounce.settle_owner(
                        store, key, owner, previous, ttl, meta, now,
                        runtime.settings.revoked_ttl,
                    )
                    capped = debounce.cap_eta(options, start, max_wait)
            elif cancels:
                cancelled = cancel.cancel_and_acquire(
                    self,
                    store,
                    key,
                    owner,
                    ttl,
                    meta,
                    task_id=task_id,
                    wait=call.cancel_wait,
                    signal=call.cancel_signal,
                )
            else:
                holder = store.acquire(key, owner, ttl, meta)
        except StoreContention:
            raise  # the store answers: contention is never an outage
        except StoreError as exc:
            # The write may still land when the store answers again (a paused
            # or slow server): the published message carries the owner token,
            # so it owns and releases such a lock; if nothing is published,
            # the lock is released as soon as the store answers.
            orphan = runtime.add_orphan(key, owner, ttl)
            header = LockHeader(key, until, call.unique_for, takes_over, owner, keep_last)
            result = self._publish_unlocked(exc, key, task_id, publish, header)
            runtime.forget_orphan(orphan)
            return result

        if holder is not None and holder.owner != owner:
            # (A holder with this call's own token is this call's write, seen
            # again by a client that re-sent the command after losing its reply.)
            return self._held(call, key, holder, task_id, args, kwargs, options, publish, owner)
        refused = rates.admit_publish(
            self, call.on_duplicate, store, key, task_id, args, kwargs, options,
            give_back=lambda: self._give_back(store, key, owner, task_id, previous),
            extend=lambda wait: store.extend(key, owner, ttl + wait),
        )
        if refused is not None:
            return refused

        header = LockHeader(key, until, call.unique_for, takes_over, owner, keep_last)
        policy = "replace+max_wait" if max_wait is not None and capped else call.on_duplicate.value
        return self._publish_taken(
            store, key, task_id, ttl, header, publish,
            previous=previous, cancelled=cancelled, policy=policy,
        )  # fmt: skip

    def _publish_taken(
        self,
        store: LockStore,
        key: str,
        task_id: str,
        ttl: float,
        header: LockHeader,
        publish: Callable[[str, LockHeader], Any],
        *,
        previous: Lock | None,
        cancelled: Lock | None,
        policy: str,
    ) -> Any:
        """The key is this call's: publish, then deal with the holder it was taken from."""
        self.dedup_config().runtime.metrics.incr(self.name, "acquired")
        lock_acquired.send(
            sender=self, key=key, task_id=task_id, ttl=ttl, policy=header.until.value
        )
        with coalesce.linked(self.backend, previous if header.last else None, task_id):
            result = self._publish_locked(
                store, key, task_id, header, publish, previous or cancelled
            )
        if cancelled is not None:
            cancel.dismiss(self, key, task_id, cancelled)
        if previous is not None:
            self._revoke_replaced(key, task_id, previous, policy)
        if header.last:
            result = coalesce.following(result)
        return mark_result(result, key, header.token)

    def _publish_unlocked(
        self,
        error: StoreError | None,
        key: str,
        task_id: str,
        publish: Callable[[str, LockHeader], Any],
        header: LockHeader = NO_LOCK,
    ) -> Any:
        """No lock could be taken: apply ``dedup_fallback``, then publish.

        A publish from inside a worker (a chain step, a callback, a chord
        body) is never refused: the parent already did its work, and
        failing it for a dedup reason would fail its whole canvas. The
        message carries ``header`` (its owner token, when an acquire was
        attempted): its start claim takes or confirms the lock.
        """
        try:
            self.dedup_config().runtime.fall_back(self.name, error)
        except DeduplicationUnavailable as exc:
            if self.app.current_worker_task is None:
                raise
            logger.warning(
                "celery-dedup: %s published without a lock from inside a worker "
                "(dedup_fallback='closed' never fails the parent task): %s",
                self.name,
                exc,
            )
        return mark_result(publish(task_id, header), key, header.token)

    def _held(
        self,
        call: ResolvedOptions,
        key: str,
        holder: Lock,
        task_id: str,
        args: Any,
        kwargs: Any,
        options: Mapping[str, Any],
        publish: Callable[[str, LockHeader], Any],
        owner: str = "",
    ) -> Any:
        """What a call whose key is held does.

        A call that cannot be suppressed without losing work is published
        without a lock: a chord member or body (a chord counts on it), a
        worker-side chain step (the chain's result waits for its frozen id), a group member
        (Celery froze its id) unless its group was given a key another call
        holds. A duplicate canvas published outside a worker (a chain's first
        step, the first member of a keyed group) raises ``DuplicateTaskError``
        whatever ``on_duplicate`` says: Celery returns the canvas' result
        before the first step is published, so nothing can stand in for it.
        """
        canvas = _is_canvas(options)
        if (
            options.get("chord")
            or self._carries_chain_worker_side(options)
            or (canvas and self._must_not_raise(options))
        ):
            return mark_result(publish(task_id, NO_LOCK), key)
        group_id = options.get("group_id")
        if group_id is not None and (
            call.deduplication_key is None
            or holder.task_id == group_id
            or options.get("group_index")
        ):
            return mark_result(publish(task_id, NO_LOCK), key)
        policy = call.on_duplicate.value
        if key_reuse.conflicts(owner, holder):
            key_reuse.report(self, call.on_key_reuse, key, holder.task_id, holder.ttl)
            if call.on_key_reuse is not OnKeyReuse.IGNORE:
                policy = f"on_key_reuse={call.on_key_reuse.value}"
        return self._duplicate(
            call, key, holder, task_id, args, kwargs, options, canvas=canvas, policy=policy
        )

    def _owner_token(
        self,
        config: TaskConfig,
        call: ResolvedOptions,
        args: Any,
        kwargs: Any,
        options: Mapping[str, Any],
    ) -> str:
        """A new owner token; with the fingerprint of the arguments for a caller's key."""
        if call.deduplication_key is None or call.on_key_reuse is OnKeyReuse.IGNORE:
            return new_token()
        sent_args, sent_kwargs = self._as_sent(args, kwargs, options)
        serializer = str(options.get("serializer") or config.serializer)
        return key_reuse.token(
            key_reuse.fingerprint(config.binder, sent_args, sent_kwargs, serializer)
        )

    def _must_not_raise(self, options: Mapping[str, Any]) -> bool:
        """Inside a worker or beat, raising would fail the parent task or the schedule."""
        return self.app.current_worker_task is not None or bool(
            (options.get("headers") or {}).get("celery_beat_task")
        )

    def _take_over(
        self, store: LockStore, key: str, owner: str, ttl: float, meta: Mapping[str, str]
    ) -> Lock | None:
        """Become the holder and refuse the previous publish's start (``replace``).

        The previous owner is marked revoked before anything is published, so
        it can never run after this call returns, even if the replacing task
        runs and releases first or the revoke broadcast is lost. (A run in
        progress is not stopped by it: only its copies, should its worker
        die, are refused. ``keep_last`` relies on that: ``coalesce``.)
        """
        revoked_ttl = self.dedup_config().runtime.settings.revoked_ttl
        return replace_holder(store, key, owner, ttl, meta, revoked_ttl)

    def _restore(
        self, store: LockStore, key: str, previous: Lock, release: Callable[[], Any]
    ) -> None:
        """A replacing (or cancelling) publish failed: give the key back to the previous holder.

        The previous holder's revoked marker goes first, then ``release``
        frees this call's lock, then the key is taken for the previous
        holder: a start claim landing in between finds it held (and waits) or
        free and unrevoked (and runs), never revoked with the key free.
        """
        try:
            store.unrevoke(key, previous.owner)
        except StoreError as exc:
            logger.warning(
                "celery-dedup: could not restore the lock of %s[%s] after a failed replace: %s",
                self.name,
                previous.task_id,
                exc,
            )
            release()
            return
        release()
        try:
            meta = {
                "task_name": previous.task_name,
                "policy": previous.policy,
                "task_id": previous.task_id,
                "started": "1" if previous.started else "",
            }
            holder = store.acquire(key, previous.owner, max(previous.ttl, 1.0), meta)
        except StoreError as exc:
            logger.warning(
                "celery-dedup: could not restore the lock of %s[%s] after a failed replace: %s",
                self.name,
                previous.task_id,
                exc,
            )
            return
        if holder is not None:
            # Another call took the free key first: its message runs the work.
            logger.info(
                "celery-dedup: %s[%s] was replaced by a failed publish and then by %s",
                self.name,
                previous.task_id,
                holder.task_id,
            )

    def _give_back(
        self, store: LockStore, key: str, owner: str, task_id: str, previous: Lock | None
    ) -> None:
        """A call refused after its lock was taken (its rate limit): free the lock."""

        def release() -> None:
            worker.release(self, store, key, owner, task_id, "rate_limited")

        if previous is None:
            release()
        else:
            self._restore(store, key, previous, release)

    def _publish_locked(
        self,
        store: LockStore,
        key: str,
        task_id: str,
        header: LockHeader,
        publish: Callable[[str, LockHeader], Any],
        previous: Lock | None = None,
    ) -> Any:
        """Publish; if publishing raises, release the lock just taken and re-raise.

        An eager call runs its body inside ``publish()``: its own hooks apply
        the policy once the body started, so only a call that raised before
        its body ran (wrong arity, an unserialisable argument) releases here.
        A replacing call gives the key back to the ``previous`` holder.
        """
        owner = header.owner(task_id)
        try:
            return publish(task_id, header)
        except BaseException:
            # (Only an eager call's body can have started: no conf lookup needed.)
            started = worker.eager_body_started(owner)

            def release() -> None:
                if not started:
                    worker.release(self, store, key, owner, task_id, "publish_failed")

            if previous is None:
                release()
            else:
                self._restore(store, key, previous, release)
            raise
        finally:
            worker.eager_body_started(owner)

    def _carries_chain_worker_side(self, options: Mapping[str, Any]) -> bool:
        """A chain step the worker publishes, the last one included (``chain=[]``).

        Celery froze its id and the chain's result waits for it: a suppressed
        step would leave that result ``PENDING`` forever.
        """
        return options.get("chain") is not None and self.app.current_worker_task is not None

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

    def _duplicate(
        self,
        call: ResolvedOptions,
        key: str,
        holder: Lock,
        duplicate_id: str,
        args: Any,
        kwargs: Any,
        options: Mapping[str, Any],
        *,
        canvas: bool = False,
        policy: str = "",
    ) -> DeduplicatedResult:
        """Report a suppressed call, then return the holder's result or raise.

        ``policy`` (what decided: the call's ``on_duplicate``, or
        ``on_key_reuse=warn``) goes into its ``task-deduplicated`` event.
        """
        runtime = self.dedup_config().runtime
        if duplicate_id == holder.task_id:
            duplicate_id = uuid()  # a deterministic id: the event needs its own uuid
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "celery-dedup: %s duplicate suppressed (key %s, ttl %.1fs)",
                self.name,
                key.rsplit(":", 1)[-1][:16],
                holder.ttl,
            )
        runtime.metrics.incr(self.name, "deduplicated")
        task_deduplicated.send(
            sender=self,
            key=key,
            existing_task_id=holder.task_id,
            duplicate_id=duplicate_id,
            args=args,
            kwargs=kwargs,
            ttl=holder.ttl,
        )
        if runtime.settings.send_events:
            events.send_deduplicated(
                self.app,
                task_name=self.name,
                duplicate_id=duplicate_id,
                holder_id=holder.task_id,
                args=args,
                kwargs=kwargs,
                policy=policy or call.on_duplicate.value,
            )
        raises = canvas or call.on_duplicate is OnDuplicate.RAISE
        if raises and not self._must_not_raise(options):
            raise DuplicateTaskError(
                task_name=self.name, key=key, existing_task_id=holder.task_id, ttl=holder.ttl
            )
        return DeduplicatedResult(
            holder.task_id,
            app=self.app,
            backend=self.backend,
            deduplication_key=key,
            # The owner token is the holder's proof of ownership: never hand it out.
            lock=holder.without_owner(),
            duplicate_id=duplicate_id,
        )

    def _revoke_replaced(
        self, key: str, task_id: str, previous: Lock, policy: str = "replace"
    ) -> None:
        """Tell workers to drop the replaced message (saves work; its start claim refuses it).

        A ``keep_last`` holder whose run is in progress is followed, not
        replaced: no revoke is broadcast (its run goes on to its end).
        """
        self.dedup_config().runtime.metrics.incr(self.name, "replaced")
        follows = policy == OnDuplicate.KEEP_LAST.value and previous.started
        lock_replaced.send(
            sender=self,
            key=key,
            task_id=task_id,
            previous_task_id=previous.task_id,
            policy=policy,
            follow_up=follows,
        )
        if not follows:
            cancel.drop_message(self, key, previous.task_id, task_id, "replaced")

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
        """Run the body under the start claim; release per policy before the result is stored.

        The tracer stores SUCCESS/FAILURE only after this returns, so a
        ``result.get()`` that returns means the lock is already released.
        """
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        slot = slots.enter(self, request, args, kwargs)  # a full limit defers the message
        try:
            return self._call_claimed(request, args, kwargs)
        finally:
            slots.leave(slot)

    def _call_claimed(self, request: Context, args: Any, kwargs: Any) -> Any:
        """``__call__`` inside the task's concurrency slot (if it has a limit)."""
        held = worker.claim_at_start(self, str(request.id), args, kwargs, request)
        if held is None:
            return super().__call__(*args, **kwargs)
        request.dedup_held = held  # type: ignore[attr-defined]  # seen by on_replace
        try:
            retval = super().__call__(*args, **kwargs)
        except Retry:
            worker.finish(self, held, Outcome.RETRIED)  # the retry holds the lock
            raise
        except Ignore:
            worker.finish(self, held, Outcome.IGNORED)
            raise
        except Reject as exc:
            requeued = getattr(exc, "requeue", False)
            worker.finish(
                self, held, Outcome.REQUEUED if requeued else Outcome.REJECTED
            )
            raise
        except Exception:
            worker.finish(self, held, Outcome.FAILURE)
            raise
        worker.finish(self, held, Outcome.SUCCESS)
        return retval

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


def _is_canvas(options: Mapping[str, Any]) -> bool:
    """A group member or a chain's first step (not a chord: chords publish members anyway)."""
    return bool((options.get("group_id") or options.get("chain")) and not options.get("chord"))
