"""celery-once's ``QueueOnce`` and ``AlreadyQueued`` on top of ``DedupTask``.

Replace ``from celery_once import QueueOnce, AlreadyQueued`` with
``from celery_dedup.compat.celery_once import QueueOnce, AlreadyQueued``.
The ``once`` option maps onto celery-dedup's:

* ``keys`` → ``unique_on`` (``[]``: one lock per task, whatever the arguments);
* ``timeout`` → ``unique_for`` (else ``ONCE['settings']['default_timeout']``,
  else ``dedup_default_ttl``);
* ``graceful`` → ``on_duplicate="existing"``; otherwise ``"raise"``, raised
  as ``AlreadyQueued``;
* ``unlock_before_run`` → ``unique_until="start"``; otherwise ``"finish"``.

``ONCE['settings']['url']`` (Redis backend) becomes ``dedup_store`` when that
is unset; the File backend's ``location`` becomes a SQLite store file there;
any other backend (a project's own, often over Django's cache) becomes
``django-cache`` in a Django project with a cache, else the app's derived
store, with a warning naming it.
An override of ``get_key`` decides the lock, as in celery-once. Behaviour
differences are listed in ``docs/migrating.md``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..api import release
from ..exceptions import DuplicateTaskError, InvalidOptionError
from ..identity import as_delivered
from ..options import ResolvedOptions, validate_unique_for
from ..policy import UniqueUntil
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

__all__ = ["AlreadyQueued", "QueueOnce"]

#: the namespace of keys an overridden ``get_key`` makes
NAMESPACE = "celery-once"
#: the task attribute each ``once`` entry sets (an explicit attribute wins)
_MAPPED = ("unique_on", "unique_for", "on_duplicate")
_REDIS_BACKENDS = frozenset({"celery_once.backends.Redis", "celery_once.backends.redis.Redis"})
_FILE_BACKENDS = frozenset({"celery_once.backends.File", "celery_once.backends.file.File"})
#: the SQLite file that stands for the File backend's lock directory
_FILE_STORE = "celery-dedup-locks.sqlite3"


class AlreadyQueued(DuplicateTaskError):
    """A ``QueueOnce`` call found its lock held and ``graceful`` was off.

    As in celery-once, ``AlreadyQueued(countdown)`` has ``countdown`` (the
    seconds left before the holder's lock expires), ``message``, ``args ==
    (countdown,)`` and ``str() == str(countdown)``; it is also a
    ``DuplicateTaskError`` with the holder's ``existing_task_id``.
    """

    def __init__(
        self,
        countdown: float,
        task_name: str = "",
        key: str = "",
        existing_task_id: str = "",
    ) -> None:
        super().__init__(task_name, key, existing_task_id, countdown)
        self._keep(str(countdown), countdown)
        self.countdown = countdown
        self.message = f"Expires in {countdown} seconds"


def _once_mapping(value: Any, option: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidOptionError(option, value, "a dict of keys, graceful, timeout, ...")
    return value


def _keys(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidOptionError("once['keys']", value, "a list of parameter names")
    return tuple(value)


def _mapped(once: Mapping[str, Any]) -> dict[str, Any]:
    """The ``DedupTask`` attributes a ``once`` dict stands for."""
    return {
        "unique_on": _keys(once.get("keys")),
        "unique_for": once.get("timeout"),
        "on_duplicate": "existing" if once.get("graceful") else "raise",
    }


def _snapshot(once: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A comparable copy of ``once`` (it may be changed in place between calls)."""
    return tuple(sorted((str(key), repr(value)) for key, value in once.items()))


def once_settings(app: Celery) -> Mapping[str, Any]:
    """``app.conf.ONCE['settings']``, or ``{}`` when celery-once is not configured."""
    once = app.conf.get("ONCE")
    settings = once.get("settings") if isinstance(once, Mapping) else None
    return settings if isinstance(settings, Mapping) else {}


def _default_timeout(app: Celery) -> float | None:
    return validate_unique_for(
        once_settings(app).get("default_timeout"), "ONCE['settings']['default_timeout']"
    )


def file_store_url(location: str | None) -> str:
    """The SQLite store standing for a File backend whose lock directory is ``location``."""
    directory = os.path.abspath(location or os.path.join(tempfile.gettempdir(), "celery_once"))
    os.makedirs(directory, exist_ok=True)
    return "db+sqlite:///" + os.path.join(directory, _FILE_STORE)


def adopt_once_settings(app: Celery) -> None:
    """Map ``app.conf.ONCE`` onto an unset ``dedup_store``; warn about what has no equivalent."""
    once = app.conf.get("ONCE")
    if not isinstance(once, Mapping):
        return
    settings = once_settings(app)
    backend = class_path(once.get("backend", "celery_once.backends.Redis"))
    if backend in _REDIS_BACKENDS:
        adopt_setting(app, "dedup_store", settings.get("url"))
    elif backend in _FILE_BACKENDS:
        if app.conf.get("dedup_store") is None:
            adopt_setting(app, "dedup_store", file_store_url(settings.get("location")))
    else:
        adopt_matching_store(app, f"ONCE['backend']={backend!r}")
    if settings.get("blocking"):
        warn_once(app, "ONCE['settings']['blocking'] is ignored: taking a lock never waits")


class OnceBackend:
    """``QueueOnce.once_backend``: celery-once's backend calls on the app's lock store."""

    def __init__(self, task: QueueOnce) -> None:
        self.task = task

    def clear_lock(self, key: str) -> bool:
        """Release the lock ``key`` (from ``get_key``), whoever holds it; return whether one was."""
        app = self.task.app
        return release(store_key(app, NAMESPACE, key, "key"), force=True, app=app)


class QueueOnce(DedupTask):
    """celery-once's base task: ``@app.task(base=QueueOnce, once={...})``.

    A duplicate call raises ``AlreadyQueued``, or with ``graceful`` returns
    the holder's ``DeduplicatedResult``. The lock is released after the task
    succeeds or finally fails (``unlock_before_run``: just before it runs).
    """

    #: celery-once's options: ``keys``, ``timeout``, ``graceful``, ``unlock_before_run``;
    #: read on every call, as celery-once does
    once: Mapping[str, Any] = {"graceful": False, "unlock_before_run": False}
    _once_written: frozenset[str] = frozenset()
    on_duplicate = "raise"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "once" in cls.__dict__:
            # Like celery-once, a class's ``once`` replaces its base's whole.
            # Mapped here too, so a bad ``once`` fails at definition.
            mapped = _mapped(_once_mapping(cls.__dict__["once"], "once"))
            written = {name for name in _MAPPED if name not in cls.__dict__}
            for name in written:
                setattr(cls, name, mapped[name])
            cls._once_written = frozenset(written)
        super().__init_subclass__(**kwargs)

    def dedup_config(self) -> TaskConfig:
        """The options, re-mapped from ``self.once`` whenever it changed (as celery-once reads).

        celery-once reads ``self.once`` on every call, so a base class's
        ``once`` changed in place, or ``task.once`` reassigned at run time,
        takes effect on the next call; options given explicitly on the task
        (``@app.task(base=QueueOnce, unique_for=...)``) still win.
        """
        once = _once_mapping(self.once, "once")
        seen = _snapshot(once)
        if seen != self.__dict__.get("_once_seen"):
            mapped = _mapped(once)
            for name in _MAPPED:
                if not self._explicit(name):
                    self.__dict__[name] = mapped[name]
            self.__dict__["_once_seen"] = seen
            self._dedup_config = None
        return super().dedup_config()

    @classmethod
    def _explicit(cls, name: str) -> bool:
        """Whether ``name`` was set on the task itself rather than mapped from ``once``."""
        for klass in cls.__mro__:
            if klass is QueueOnce:
                return False
            if name in klass.__dict__ and name not in klass.__dict__.get("_once_written", ()):
                return True
        return False

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Adopt ``app.conf.ONCE`` for ``dedup_store`` when that is unset."""
        super().on_bound(app)
        adopt_once_settings(app)

    def build_dedup_config(self) -> TaskConfig:
        adopt_once_settings(self.app)
        config = super().build_dedup_config()
        default = _default_timeout(self.app)
        if self.unique_for is None and default is not None:
            config = dataclasses.replace(config, unique_for=default)
        if self.unique_until is None:
            until = UniqueUntil.START if self.unlock_before_run() else UniqueUntil.FINISH
            config = dataclasses.replace(config, unique_until=until)
        return config

    # -- celery-once's attributes --------------------------------------------

    @property
    def config(self) -> Any:
        """The app's configuration (``app.conf``)."""
        return self.app.conf

    @property
    def once_config(self) -> Mapping[str, Any]:
        """``app.conf.ONCE`` (``{}`` when unset)."""
        once = self.app.conf.get("ONCE")
        return once if isinstance(once, Mapping) else {}

    @property
    def default_timeout(self) -> float:
        """Seconds a lock lives when ``once`` has no ``timeout``."""
        default = _default_timeout(self.app)
        return self.dedup_config().runtime.settings.default_ttl if default is None else default

    @property
    def once_backend(self) -> OnceBackend:
        """celery-once's backend interface: ``clear_lock(key)``."""
        return OnceBackend(self)

    def unlock_before_run(self) -> bool:
        """Whether the lock is released just before the task runs (``once``)."""
        return bool(self.once.get("unlock_before_run", False))

    def get_key(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> str | None:
        """The lock key of a call with these arguments (``None``: the call takes no lock).

        Override it to choose the lock yourself, as in celery-once: every
        call then locks on the string it returns.
        """
        return native_key(self, args, kwargs)

    def dedup_key(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        call: ResolvedOptions,
        queue: Any = None,
        serializer: str | None = None,
    ) -> str | None:
        """The call's key; an overridden ``get_key`` decides unless the call gives a key."""
        if call.deduplication_key is None and type(self).get_key is not QueueOnce.get_key:
            args, kwargs = as_delivered(args, kwargs, serializer or self.dedup_config().serializer)
            return store_key(self.app, NAMESPACE, self.get_key(args, kwargs), "get_key")
        return super().dedup_key(args, kwargs, call, queue, serializer)

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
        """Enqueue unless already queued; also takes celery-once's per-call ``once={...}``.

        Per call, ``once`` honours ``graceful`` and ``timeout`` (as celery-once
        does); a ``timeout`` of ``None`` keeps the task's. Raises
        ``AlreadyQueued`` for a duplicate that is not graceful, and
        ``ImproperlyConfigured`` when the app has no lock store.
        """
        require_store(self, "celery-once", "ONCE['settings']['url']")
        once = _once_mapping(options.pop("once", None), "once")
        if "graceful" in once:
            options.setdefault("on_duplicate", "existing" if once["graceful"] else "raise")
        if once.get("timeout") is not None:
            options.setdefault("unique_for", once["timeout"])
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except AlreadyQueued:
            raise
        except DuplicateTaskError as exc:
            raise AlreadyQueued(
                exc.ttl or 0.0, exc.task_name, exc.key, exc.existing_task_id
            ) from None
