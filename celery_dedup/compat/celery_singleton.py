"""celery-singleton's ``Singleton``, ``DuplicateTaskError`` and ``clear_locks``.

Replace ``from celery_singleton import Singleton, DuplicateTaskError, clear_locks``
(and ``from celery_singleton.exceptions import CelerySingletonException``)
with ``from celery_dedup.compat.celery_singleton import ...``. The task
attributes map onto celery-dedup's:

* ``unique_on`` → ``unique_on`` (an empty list: every argument in 0.3.1,
  the task name only with ``singleton_version="master"``);
* ``lock_expiry`` → ``unique_for`` (else ``singleton_lock_expiry``, else
  ``dedup_default_ttl``: a celery-dedup lock always has a TTL);
* ``raise_on_duplicate`` → ``on_duplicate="raise"`` (else
  ``singleton_raise_on_duplicate``, else ``dedup_default_on_duplicate``);
* the lock is released when the task succeeds or finally fails
  (``unique_until="finish"``).

``singleton_backend_url`` and ``singleton_key_prefix`` become ``dedup_store``
and ``dedup_key_prefix`` when those are unset; ``singleton_json_encoder_class``
encodes the arguments the key is made of. Overrides of ``generate_lock`` and
``on_duplicate`` are honoured as in celery-singleton. Behaviour differences
are listed in ``docs/migrating.md``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kombu.utils.imports import symbol_by_name

from ..api import release
from ..exceptions import E_DUPLICATE, DedupError, InvalidOptionError
from ..exceptions import DuplicateTaskError as _DuplicateTaskError
from ..header import new_token
from ..identity import ArgumentBinder, as_delivered
from ..lifecycle import meta_for
from ..options import OnDuplicate, ResolvedOptions, validate_bool, validate_positive_seconds
from ..runtime import runtime_for
from ..stores.base import LockStore
from ..task import DedupTask, TaskConfig
from . import (
    adopt_matching_store,
    adopt_setting,
    class_path,
    native_key,
    require_store,
    store_key,
    warn_once,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "CelerySingletonException",
    "DuplicateTaskError",
    "Singleton",
    "clear_locks",
]

#: the namespace of keys an overridden ``generate_lock`` makes
NAMESPACE = "celery-singleton"
_REDIS_BACKENDS = frozenset(
    {"celery_singleton.backends.redis.RedisBackend", "celery_singleton.backends.RedisBackend"}
)
#: ``singleton_version``: the celery-singleton whose ``unique_on=[]`` applies
VERSIONS = ("0.3.1", "master")


class CelerySingletonException(DedupError):
    """Root of the celery-singleton shim's exceptions (celery-singleton's name)."""


class DuplicateTaskError(CelerySingletonException, _DuplicateTaskError):
    """celery-singleton's ``DuplicateTaskError(message, task_id)``.

    Raised by ``Singleton`` tasks with ``raise_on_duplicate``; ``task_id`` is
    the holder's id (also ``existing_task_id``). It is celery-dedup's
    ``DuplicateTaskError`` too.
    """

    def __init__(
        self,
        message: str,
        task_id: str,
        task_name: str = "",
        key: str = "",
        ttl: float | None = None,
    ) -> None:
        super().__init__(task_name, key, task_id, ttl)
        self._keep(message, message, task_id, task_name, key, ttl)

    @property
    def task_id(self) -> str:
        """The id of the task that holds the lock."""
        return self.existing_task_id


def adopt_singleton_settings(app: Celery) -> None:
    """Copy the ``singleton_*`` settings into unset ``dedup_*``; warn about the rest."""
    conf = app.conf
    adopt_setting(app, "dedup_store", conf.get("singleton_backend_url"))
    adopt_setting(app, "dedup_key_prefix", conf.get("singleton_key_prefix"))
    backend = conf.get("singleton_backend_class")
    if backend is not None and class_path(backend) not in _REDIS_BACKENDS:
        adopt_matching_store(app, f"singleton_backend_class={class_path(backend)!r}")
    if conf.get("singleton_backend_kwargs"):
        warn_once(app, "singleton_backend_kwargs is ignored; set dedup_store_options instead")


def clear_locks(app: Celery) -> int:
    """Release every lock of ``app`` (all tasks), each owner-checked; return how many.

    Like celery-singleton's, meant for ``worker_ready`` after a crash. A lock
    whose holder changes while this runs is left to its new holder. Raises
    ``ScanNotSupported`` on a store that cannot list its locks (memcached).
    """
    adopt_singleton_settings(app)
    runtime = runtime_for(app)
    store = runtime.store
    if store is None:
        raise DedupError("this app has no lock store (set dedup_store)")
    locks = list(store.scan(runtime.settings.key_prefix + ":"))
    return sum(release(lock.key, owner=lock.owner, app=app) for lock in locks)


def _encoded(value: Any, encoder: json.JSONEncoder) -> Any:
    """``value`` with what ``encoder.default`` converts converted, as ``json.dumps`` would."""
    if isinstance(value, (list, tuple)):
        return [_encoded(item, encoder) for item in value]
    if isinstance(value, dict):
        return {key: _encoded(item, encoder) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float)):
        return value
    try:
        converted = encoder.default(value)
    except TypeError:
        return value  # celery-dedup canonicalises it (dates, UUIDs, ...) or refuses it
    return _encoded(converted, encoder)


class Singleton(DedupTask):
    """celery-singleton's base task: ``@app.task(base=Singleton, unique_on=[...])``.

    A duplicate call returns the holder's ``AsyncResult`` (a
    ``DeduplicatedResult``), or raises ``DuplicateTaskError`` with
    ``raise_on_duplicate``.
    """

    #: ``on_duplicate`` is celery-singleton's hook here, not the option
    dedup_not_options = frozenset({"on_duplicate"})
    #: raise ``DuplicateTaskError`` on a duplicate; ``None`` asks the app
    raise_on_duplicate: bool | None = None
    #: seconds the lock lives; ``None`` asks ``singleton_lock_expiry``, then ``dedup_default_ttl``
    lock_expiry: float | None = None
    unique_until = "finish"

    _json_encoder: json.JSONEncoder | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        attrs = cls.__dict__
        if "on_duplicate" in attrs and not callable(attrs["on_duplicate"]):
            raise InvalidOptionError(
                "on_duplicate",
                attrs["on_duplicate"],
                "celery-singleton's hook on_duplicate(self, existing_task_id); "
                "use raise_on_duplicate, or on_duplicate= per call",
            )
        if attrs.get("raise_on_duplicate") is not None:
            validate_bool(attrs["raise_on_duplicate"], "raise_on_duplicate")
        if "lock_expiry" in attrs and "unique_for" not in attrs:
            cls.unique_for = attrs["lock_expiry"]
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Adopt the ``singleton_*`` store URL and key prefix for unset ``dedup_*``."""
        super().on_bound(app)
        adopt_singleton_settings(app)

    def build_dedup_config(self) -> TaskConfig:
        conf = self.app.conf
        adopt_singleton_settings(self.app)
        config = super().build_dedup_config()
        expiry = conf.get("singleton_lock_expiry")
        if self.unique_for is None and expiry is not None:
            seconds = validate_positive_seconds(expiry, "singleton_lock_expiry")
            config = dataclasses.replace(config, unique_for=seconds)
        raising = self.raise_on_duplicate
        if raising is None and conf.get("singleton_raise_on_duplicate") is not None:
            raising = validate_bool(
                conf.get("singleton_raise_on_duplicate"), "singleton_raise_on_duplicate"
            )
        if raising is not None:
            on_duplicate = OnDuplicate.RAISE if raising else OnDuplicate.EXISTING
            config = dataclasses.replace(config, on_duplicate=on_duplicate)
        version = conf.get("singleton_version") or VERSIONS[0]
        if version not in VERSIONS:
            raise InvalidOptionError("singleton_version", version, VERSIONS)
        if self.unique_on is not None and not self.unique_on and version != "master":
            # celery-singleton 0.3.1: an empty unique_on means every argument
            config = dataclasses.replace(config, binder=ArgumentBinder(self.run, self.name))
        encoder = conf.get("singleton_json_encoder_class")
        if encoder is not None:
            self._json_encoder = symbol_by_name(encoder)()
        return config

    # -- celery-singleton's methods --------------------------------------------

    def generate_lock(
        self,
        task_name: str,
        task_args: Sequence[Any] | None = None,
        task_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The lock key of a call of this task with these arguments.

        Override it to choose the lock yourself, as in celery-singleton: every
        call then locks on the string it returns. (``task_name`` is accepted
        for celery-singleton's signature; the key is always this task's.)
        """
        key = native_key(self, *self._encode(task_args, task_kwargs))
        assert key is not None, "a Singleton call always takes a lock"
        return key

    def get_existing_task_id(self, lock: str) -> str | None:
        """The task id holding ``lock`` (from ``generate_lock``), or ``None``."""
        held = self._store().get(self._store_key(lock))
        return held.task_id if held is not None else None

    def aquire_lock(self, lock: str, task_id: str) -> bool:
        """Take ``lock`` for ``task_id`` without publishing (celery-singleton's spelling).

        The lock lives ``lock_expiry`` seconds (or the task's TTL); a message
        is never published for it, so only ``unlock``, ``release_lock`` or the
        TTL free it. Returns whether it was taken.
        """
        config = self.dedup_config()
        meta = meta_for(self, task_id, config.unique_until)
        key = self._store_key(lock)
        token = new_token()
        holder = self._store().acquire(key, token, config.unique_for, meta)
        return holder is None or holder.owner == token  # (a re-sent command sees its own write)

    def unlock(self, lock: str) -> None:
        """Release ``lock`` (from ``generate_lock``), whoever holds it."""
        release(self._store_key(lock), force=True, app=self.app)

    def release_lock(
        self, task_args: Sequence[Any] | None = None, task_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """Release the lock these arguments map to, whoever holds it."""
        self.unlock(self.generate_lock(self.name, task_args, task_kwargs))

    # The hook shares the option's name (hence dedup_not_options).
    def on_duplicate(self, existing_task_id: str) -> Any:  # type: ignore[override]
        """celery-singleton's hook, called for a duplicate when a subclass overrides it.

        Raises ``DuplicateTaskError`` with ``raise_on_duplicate``, else returns
        the holder's ``AsyncResult``; an override may return anything.
        """
        if self.dedup_config().on_duplicate is OnDuplicate.RAISE:
            raise DuplicateTaskError(
                E_DUPLICATE.format(task_name=self.name), existing_task_id, self.name
            )
        return self.AsyncResult(existing_task_id)

    # -- keys ------------------------------------------------------------------

    def _encode(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> tuple[Sequence[Any] | None, Mapping[str, Any] | None]:
        self.dedup_config()  # resolves the encoder
        encoder = self._json_encoder
        if encoder is None:
            return args, kwargs
        return _encoded(list(args or ()), encoder), _encoded(dict(kwargs or {}), encoder)

    def _store_key(self, lock: str) -> str:
        return store_key(self.app, NAMESPACE, lock, "generate_lock")

    def _store(self) -> LockStore:
        require_store(self, "celery-singleton", "singleton_backend_url")
        store = self.dedup_config().runtime.store
        assert store is not None
        return store

    def dedup_key(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        call: ResolvedOptions,
        queue: Any = None,
        serializer: str | None = None,
    ) -> str | None:
        """The call's key; an overridden ``generate_lock`` decides unless the call gives a key."""
        overridden = type(self).generate_lock is not Singleton.generate_lock
        if call.deduplication_key is None and overridden:
            args, kwargs = as_delivered(args, kwargs, serializer or self.dedup_config().serializer)
            lock = self.generate_lock(self.name, list(args), dict(kwargs))
            return self._store_key(lock)
        return super().dedup_key(*self._encode(args, kwargs), call, queue, serializer)

    # -- enqueue ---------------------------------------------------------------

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
        """Enqueue, or return the holder's result; raises ``DuplicateTaskError`` if asked to.

        A subclass's ``on_duplicate(existing_task_id)`` decides what a
        duplicate returns (or raises). Raises ``ImproperlyConfigured`` when
        the app has no lock store.
        """
        require_store(self, "celery-singleton", "singleton_backend_url")
        hooked = type(self).on_duplicate is not Singleton.on_duplicate
        try:
            result = super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except DuplicateTaskError:
            raise
        except _DuplicateTaskError as exc:
            if hooked:
                return self.on_duplicate(exc.existing_task_id)
            raise DuplicateTaskError(
                str(exc),
                exc.existing_task_id,
                exc.task_name,
                exc.key,
                exc.ttl,
            ) from None
        if hooked and getattr(result, "deduplicated", False):
            return self.on_duplicate(result.id)
        return result
