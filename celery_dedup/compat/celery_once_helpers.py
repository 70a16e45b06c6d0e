"""celery-once's ``celery_once.helpers``, for code that imports them.

After ``pip uninstall celery-once`` nothing under ``celery_once`` imports;
replace ``from celery_once.helpers import now_unix`` with
``from celery_dedup.compat.celery_once_helpers import now_unix``. The
functions behave as celery-once's: ``queue_once_key`` still builds
celery-once's ``qo_<task>_<k>-<v>`` string (the shim's own locks use
celery-dedup keys; an overridden ``QueueOnce.get_key`` returning this string
is hashed into one, so equal strings still share one lock).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

__all__ = ["get_redis", "kwargs_to_list", "now_unix", "parse_redis_details", "queue_once_key"]


def now_unix() -> int:
    """The current time in whole UNIX seconds."""
    return int(time.time())


def kwargs_to_list(kwargs: Mapping[str, Any]) -> list[str]:
    """``{"b": 2, "a": 1}`` → ``["a-1", "b-2"]``, sorted by name then value."""
    pairs = sorted(kwargs.items(), key=lambda item: (str(item[0]), str(item[1])))
    return [f"{name}-{value}" for name, value in pairs]


def queue_once_key(
    name: str, kwargs: Mapping[str, Any], restrict_to: Iterable[str] | None = None
) -> str:
    """celery-once's key string: ``qo_<name>_<k>-<v>…``, restricted to ``restrict_to``."""
    chosen = kwargs if restrict_to is None else {key: kwargs[key] for key in restrict_to}
    return "_".join(["qo", name, *kwargs_to_list(chosen)])


def parse_redis_details(url: str) -> dict[str, Any]:
    """``host``, ``password``, ``port`` (and ``db`` when the path is a number) of a Redis URL."""
    parsed = urlparse(url)
    details: dict[str, Any] = {
        "host": parsed.hostname,
        "password": parsed.password,
        "port": parsed.port,
    }
    db = parsed.path.lstrip("/")
    if db.isdigit():
        details["db"] = int(db)
    return details


def get_redis(url: str) -> Any:
    """A ``redis.StrictRedis`` client for ``url`` (needs the ``redis`` extra)."""
    from redis import StrictRedis

    return StrictRedis(**parse_redis_details(url))
