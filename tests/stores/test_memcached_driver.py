"""A missing memcached driver is a configuration error naming the extra, as for every store."""

from __future__ import annotations

import sys

import pytest
from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured

from celery_dedup import ImproperlyConfigured
from celery_dedup.stores import store_from_url


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:11211", "cache+memcached://127.0.0.1:1/"])
def test_missing_pymemcache_names_the_extra(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pymemcache: ImproperlyConfigured (ours and Celery's) saying what to install."""
    monkeypatch.setitem(sys.modules, "pymemcache", None)  # import pymemcache fails
    with pytest.raises(ImproperlyConfigured) as excinfo:
        store_from_url(url)
    assert isinstance(excinfo.value, CeleryImproperlyConfigured)
    assert not isinstance(excinfo.value, ModuleNotFoundError)
    assert "pip install 'celery-dedup[memcached]'" in str(excinfo.value)
    assert "memcached (127.0.0.1:" in str(excinfo.value)
