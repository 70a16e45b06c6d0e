"""The broker and result backend of an app, read as Celery reads them.

Celery's ``conf.broker_url`` and ``conf.result_backend`` are properties:
``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` in the environment win
over the settings, and old names (``broker_host``) count. Reading the raw
keys (``conf.get("broker_url")``) misses all that. A broker may also be a
failover list: a list of URLs, or URLs separated by ``;`` (kombu tries them
in turn); the first is the one in use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["broker_scheme", "broker_url", "broker_urls", "result_backend"]


def broker_urls(conf: Any) -> list[str]:
    """Every broker URL of the app, in failover order (``[]``: none configured)."""
    # Celery's property (a plain mapping has none: its key).
    given = getattr(conf, "broker_url", None) or conf.get("broker_url")
    if isinstance(given, str):
        given = given.split(";")
    if not isinstance(given, (list, tuple)):
        return []
    return [url.strip() for url in given if isinstance(url, str) and url.strip()]


def broker_url(conf: Any) -> str:
    """The broker URL in use: the first of a failover list (``""``: none configured)."""
    urls = broker_urls(conf)
    return urls[0] if urls else ""


def broker_scheme(conf: Any) -> str:
    """The scheme of the broker in use (``"redis"``; ``""``: none configured)."""
    return broker_url(conf).partition("://")[0]


def result_backend(conf: Any) -> str:
    """The result backend URL (``""``: none configured, or not given as a URL)."""
    given = getattr(conf, "result_backend", None) or conf.get("result_backend")
    return given.strip() if isinstance(given, str) else ""
