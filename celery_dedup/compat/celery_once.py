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

``ONCE['settings']['url']`` becomes ``dedup_store`` when that is unset.
Behaviour differences are listed in ``docs/migrating.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..exceptions import DuplicateTaskError, InvalidOptionError
from ..options import validate_unique_for
from ..task import DedupTask, TaskConfig
from . import adopt_setting

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["AlreadyQueued", "QueueOnce"]

#: the task attribute each ``once`` entry sets (an explicit attribute wins)
_MAPPED = ("unique_on", "unique_for", "on_duplicate", "unique_until")


class AlreadyQueued(DuplicateTaskError):
    """A ``QueueOnce`` call found its lock held and ``graceful`` was off.

    A ``DuplicateTaskError``; ``countdown`` (celery-once's attribute) is the
    seconds left before the holder's lock expires.
    """

    def __init__(
        self,
        countdown: float,
        *,
        task_name: str = "",
        key: str = "",
        existing_task_id: str = "",
    ) -> None:
        super().__init__(
            task_name=task_name, key=key, existing_task_id=existing_task_id, ttl=countdown
        )
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


def once_settings(app: Celery) -> Mapping[str, Any]:
    """``app.conf.ONCE['settings']``, or ``{}`` when celery-once is not configured."""
    once = app.conf.get("ONCE")
    settings = once.get("settings") if isinstance(once, Mapping) else None
    return settings if isinstance(settings, Mapping) else {}


class QueueOnce(DedupTask):
    """celery-once's base task: ``@app.task(base=QueueOnce, once={...})``.

    A duplicate call raises ``AlreadyQueued``, or with ``graceful`` returns
    the holder's ``DeduplicatedResult``. The lock is released after the task
    succeeds or finally fails (``unlock_before_run``: just before it runs).
    """

    #: celery-once's options: ``keys``, ``timeout``, ``graceful``, ``unlock_before_run``
    once: Mapping[str, Any] = {"graceful": False, "unlock_before_run": False}
    unique_until = "finish"
    on_duplicate = "raise"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "once" in cls.__dict__:
            # Like celery-once, a class's ``once`` replaces its base's whole.
            once = _once_mapping(cls.__dict__["once"], "once")
            mapped = {
                "unique_on": _keys(once.get("keys")),
                "unique_for": once.get("timeout"),
                "on_duplicate": "existing" if once.get("graceful") else "raise",
                "unique_until": "start" if once.get("unlock_before_run") else "finish",
            }
            for name in _MAPPED:
                if name not in cls.__dict__:
                    setattr(cls, name, mapped[name])
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Adopt ``ONCE['settings']['url']`` as ``dedup_store`` when that is unset."""
        super().on_bound(app)
        adopt_setting(app, "dedup_store", once_settings(app).get("url"))

    def build_dedup_config(self) -> TaskConfig:
        settings = once_settings(self.app)
        adopt_setting(self.app, "dedup_store", settings.get("url"))
        config = super().build_dedup_config()
        default = validate_unique_for(
            settings.get("default_timeout"), "ONCE['settings']['default_timeout']"
        )
        if self.unique_for is None and default is not None:
            config = dataclasses.replace(config, unique_for=default)
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
        """Enqueue unless already queued; also takes celery-once's per-call ``once={...}``.

        Per call, ``once`` honours ``graceful`` and ``timeout`` (as celery-once
        does); a ``timeout`` of ``None`` keeps the task's. Raises
        ``AlreadyQueued`` for a duplicate that is not graceful.
        """
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
                exc.ttl or 0.0,
                task_name=exc.task_name,
                key=exc.key,
                existing_task_id=exc.existing_task_id,
            ) from None
