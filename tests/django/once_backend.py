"""A project's own celery-once backend over Django's cache, as Alliance Auth apps ship it.

django-eveuniverse and its siblings configure ``ONCE = {"backend":
"<project>.DjangoBackend", "settings": {}}`` with a class like this one; the
shim never calls it, only reads its class path.
"""

from __future__ import annotations

from typing import Any

from django.core.cache import cache


class DjangoBackend:
    """celery-once's backend interface on ``django.core.cache``."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @staticmethod
    def raise_or_lock(key: str, timeout: int) -> None:
        if not cache.add(key=key, value="lock", timeout=timeout):
            raise RuntimeError(f"already queued: {key}")

    @staticmethod
    def clear_lock(key: str) -> None:
        cache.delete(key)
