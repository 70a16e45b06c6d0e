"""celery-singleton's ``Singleton``, ``DuplicateTaskError`` and ``clear_locks``.

Replace ``from celery_singleton import Singleton, DuplicateTaskError, clear_locks``
with ``from celery_dedup.compat.celery_singleton import ...``. The task
attributes map onto celery-dedup's:

* ``unique_on`` → ``unique_on`` (an empty list: every argument, as before);
* ``lock_expiry`` → ``unique_for`` (else ``singleton_lock_expiry``, else
  ``dedup_default_ttl``: a celery-dedup lock always has a TTL);
* ``raise_on_duplicate`` → ``on_duplicate="raise"`` (else
  ``singleton_raise_on_duplicate``, else ``dedup_default_on_duplicate``);
* the lock is released when the task succeeds or finally fails
  (``unique_until="finish"``).

``singleton_backend_url`` and ``singleton_key_prefix`` become ``dedup_store``
and ``dedup_key_prefix`` when those are unset. Behaviour differences are
listed in ``docs/migrating.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..api import dedup_key_for, release
from ..exceptions import DedupError
from ..exceptions import DuplicateTaskError as _DuplicateTaskError
from ..options import OnDuplicate, validate_bool, validate_positive_seconds
from ..runtime import runtime_for
from ..task import DedupTask, TaskConfig
from . import adopt_setting

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["DuplicateTaskError", "Singleton", "clear_locks"]


class DuplicateTaskError(_DuplicateTaskError):
    """celery-dedup's ``DuplicateTaskError`` under celery-singleton's name.

    Raised by ``Singleton`` tasks with ``raise_on_duplicate``; ``task_id``
    (celery-singleton's attribute) is the holder's id, ``existing_task_id``.
    """

    @property
    def task_id(self) -> str:
        """The id of the task that holds the lock."""
        return self.existing_task_id


def adopt_singleton_settings(app: Celery) -> None:
    """Copy ``singleton_backend_url``/``singleton_key_prefix`` into unset ``dedup_*``."""
    adopt_setting(app, "dedup_store", app.conf.get("singleton_backend_url"))
    adopt_setting(app, "dedup_key_prefix", app.conf.get("singleton_key_prefix"))


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


class Singleton(DedupTask):
    """celery-singleton's base task: ``@app.task(base=Singleton, unique_on=[...])``.

    A duplicate call returns the holder's ``AsyncResult`` (a
    ``DeduplicatedResult``), or raises ``DuplicateTaskError`` with
    ``raise_on_duplicate``.
    """

    #: raise ``DuplicateTaskError`` on a duplicate; ``None`` asks the app
    raise_on_duplicate: bool | None = None
    #: seconds the lock lives; ``None`` asks ``singleton_lock_expiry``, then ``dedup_default_ttl``
    lock_expiry: float | None = None
    unique_until = "finish"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        attrs = cls.__dict__
        if "unique_on" in attrs and not attrs["unique_on"]:
            cls.unique_on = None  # celery-singleton: an empty unique_on means every argument
        raise_on_duplicate = attrs.get("raise_on_duplicate")
        if raise_on_duplicate is not None and "on_duplicate" not in attrs:
            raising = validate_bool(raise_on_duplicate, "raise_on_duplicate")
            cls.on_duplicate = "raise" if raising else "existing"
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
        raising = conf.get("singleton_raise_on_duplicate")
        if self.on_duplicate is None and raising is not None:
            raising = validate_bool(raising, "singleton_raise_on_duplicate")
            on_duplicate = OnDuplicate.RAISE if raising else OnDuplicate.EXISTING
            config = dataclasses.replace(config, on_duplicate=on_duplicate)
        return config

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
        """Enqueue, or return the holder's result; raises ``DuplicateTaskError`` if asked to."""
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except DuplicateTaskError:
            raise
        except _DuplicateTaskError as exc:
            raise DuplicateTaskError(
                task_name=exc.task_name,
                key=exc.key,
                existing_task_id=exc.existing_task_id,
                ttl=exc.ttl,
            ) from None

    def release_lock(
        self, task_args: Sequence[Any] | None = None, task_kwargs: Mapping[str, Any] | None = None
    ) -> bool:
        """Release the lock these arguments map to, whoever holds it; return whether one was."""
        key = dedup_key_for(self, task_args, task_kwargs)
        return key is not None and release(key, force=True, app=self.app)
