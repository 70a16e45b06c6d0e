"""The Django DB lock store: the whole contract and store-specific behaviour.

On SQLite (the test database), PostgreSQL and MariaDB (aliases added at run
time, like ``pg_alias`` in conftest.py), each also through its other code
path: SQLite without ``RETURNING`` (a transaction per acquire), MariaDB
without ``RETURNING`` (MySQL's upsert then read).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections

from celery_dedup.contrib.django import managers
from celery_dedup.contrib.django.models import DedupCounter, DedupLock
from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.stores import store_from_url
from celery_dedup.stores.django import DjangoStore
from tests.fixtures._servers import free_port
from tests.fixtures._store_case import StoreCase
from tests.stores.contract import StoreContract

META = {"task_name": "shop.tasks.sync_address", "policy": "success", "task_id": "id-1"}

MARIA_ALIAS = "dedup_maria"
MARIA_DATABASE = "celery_dedup_django"


def flush_all(alias: str) -> None:
    """Empty the lock table, revoked markers included, and the counters."""
    DedupLock.all_rows.using(alias).all().delete()
    DedupCounter.objects.using(alias).all().delete()


def add_alias(alias: str, config: dict[str, Any]) -> None:
    """Add a ``DATABASES`` alias at run time, with Django's defaults filled in."""
    full = connections.configure_settings({**connections.settings, alias: config})[alias]
    settings.DATABASES[alias] = connections.settings[alias] = full


def drop_alias(alias: str) -> None:
    """Close and forget an alias added by ``add_alias``."""
    connections[alias].close()
    del connections.settings[alias]
    settings.DATABASES.pop(alias, None)


@pytest.fixture(scope="session")
def maria_alias(mysql_server: Any, django_db_blocker: Any) -> Iterator[str]:
    """A ``DATABASES`` alias on the session's MariaDB (through PyMySQL), migrated.

    Other test modules import this fixture: the first to run creates the alias.
    """
    import pymysql

    if MARIA_ALIAS in connections.settings:
        yield MARIA_ALIAS
        return

    pymysql.install_as_MySQLdb()
    conn = mysql_server.connect()
    with conn.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {MARIA_DATABASE}")
        cursor.execute(f"CREATE DATABASE {MARIA_DATABASE} CHARACTER SET utf8mb4")
    conn.close()
    add_alias(
        MARIA_ALIAS,
        {
            "ENGINE": "django.db.backends.mysql",
            "NAME": MARIA_DATABASE,
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": str(mysql_server.port),
        },
    )
    with django_db_blocker.unblock():
        call_command("migrate", "celery_dedup", database=MARIA_ALIAS, verbosity=0)
    yield MARIA_ALIAS
    with django_db_blocker.unblock():
        drop_alias(MARIA_ALIAS)


@pytest.fixture
def store_django_maria(maria_alias: str, django_db_blocker: Any) -> Iterator[StoreCase]:
    """The Django DB store on MariaDB (``django-db://dedup_maria``)."""
    with django_db_blocker.unblock():
        flush_all(maria_alias)
        yield StoreCase(
            url=f"django-db://{maria_alias}",
            store=DjangoStore(maria_alias),
            flush=lambda: flush_all(maria_alias),
        )
        flush_all(maria_alias)


class DjangoStoreBehaviour:
    """Tests every database of the Django DB store must pass."""

    def test_acquire_then_holder_returned(self, store_case: StoreCase) -> None:
        """A second owner gets the holder back in the same call; only the holder can release."""
        store = store_case.store
        assert store.acquire("p:k", "a", 10, META) is None
        holder = store.acquire("p:k", "b", 10, META)
        assert holder is not None and holder.owner == "a"
        assert holder.task_name == META["task_name"] and holder.policy == "success"
        assert 9 < holder.ttl <= 10
        assert store.release("p:k", "b") is False
        assert store.release("p:k", "a") is True
        assert store.get("p:k") is None

    def test_same_owner_is_still_a_duplicate(self, store_case: StoreCase) -> None:
        """With deterministic ids a duplicate carries the holder's id: it is not "acquired"."""
        assert store_case.store.acquire("p:det", "same-id", 10, META) is None
        holder = store_case.store.acquire("p:det", "same-id", 10, META)
        assert holder is not None and holder.owner == "same-id"


    def test_expired_row_is_taken_over_in_place(self, store_case: StoreCase) -> None:
        """An expired row is reused by the next acquire: one row, the new holder's values."""
        from celery_dedup.contrib.django.models import DedupLock

        store = store_case.store
        assert isinstance(store, DjangoStore)
        assert store.acquire("p:exp", "old", 0.05, META) is None
        wait = DedupLock.objects.using(store.using)
        while store.get("p:exp") is not None:
            time.sleep(0.02)
        assert wait.filter(key="p:exp").count() == 1  # still there, but free
        assert store.acquire("p:exp", "new", 10, {"task_name": "t2", "policy": "finish"}) is None
        row = wait.get(key="p:exp")
        assert (row.owner, row.task_name, row.policy) == ("new", "t2", "finish")

    def test_purge_expired_deletes_only_expired_rows(self, store_case: StoreCase) -> None:
        """``purge_expired`` reclaims expired rows under a prefix and keeps live locks."""
        store = store_case.store
        assert isinstance(store, DjangoStore)
        store.acquire("p:dead", "a", 0.05, META)
        store.acquire("q:dead", "a", 0.05, META)
        store.acquire("p:live", "b", 30, META)
        while store.get("p:dead") is not None or store.get("q:dead") is not None:
            time.sleep(0.02)
        assert store.purge_expired("p:") == 1
        assert store.purge_expired() == 1
        assert [lock.key for lock in store.scan("")] == ["p:live"]

    def test_store_from_url_names_the_alias(self, store_case: StoreCase) -> None:
        """The case's URL resolves to a Django store on the same alias."""
        store = store_from_url(store_case.url)
        assert isinstance(store, DjangoStore)
        assert isinstance(store_case.store, DjangoStore)
        assert store.using == store_case.store.using


class TestSQLite(StoreContract, DjangoStoreBehaviour):
    """The Django DB store on SQLite."""

    @pytest.fixture
    def store_case(self, store_django_sqlite: StoreCase) -> StoreCase:
        """The SQLite case (revoked markers of earlier tests flushed too)."""
        flush_all("default")
        return store_django_sqlite


class TestSQLiteWithoutReturning(StoreContract, DjangoStoreBehaviour):
    """SQLite before 3.35 (no ``RETURNING``): acquire is a ``BEGIN IMMEDIATE`` transaction."""

    @pytest.fixture
    def store_case(
        self, store_django_sqlite: StoreCase, monkeypatch: pytest.MonkeyPatch
    ) -> StoreCase:
        """The SQLite case without the upsert statement."""
        monkeypatch.setattr(managers, "_has_upsert_returning", lambda connection: False)
        flush_all("default")
        return store_django_sqlite


class TestPostgres(StoreContract, DjangoStoreBehaviour):
    """The Django DB store on PostgreSQL."""

    @pytest.fixture
    def store_case(self, store_django_postgres: StoreCase, pg_alias: str) -> StoreCase:
        """The PostgreSQL case."""
        flush_all(pg_alias)
        return store_django_postgres


class TestMariaDB(StoreContract, DjangoStoreBehaviour):
    """The Django DB store on MariaDB (``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``)."""

    @pytest.fixture
    def store_case(self, store_django_maria: StoreCase) -> StoreCase:
        """The MariaDB case."""
        return store_django_maria


class TestMySQLPath(StoreContract, DjangoStoreBehaviour):
    """MySQL's path (no ``RETURNING``: the upsert, then a read, in one transaction) on MariaDB."""

    @pytest.fixture
    def store_case(
        self, store_django_maria: StoreCase, monkeypatch: pytest.MonkeyPatch
    ) -> StoreCase:
        """The MariaDB case without ``RETURNING``."""
        monkeypatch.setattr(managers, "_has_upsert_returning", lambda connection: False)
        return store_django_maria


@pytest.fixture
def down_alias(django_db_blocker: Any) -> Iterator[str]:
    """A DATABASES alias for a PostgreSQL port nothing listens on."""
    alias = "dedup_down"
    add_alias(
        alias,
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "nowhere",
            "HOST": "127.0.0.1",
            "PORT": str(free_port()),
            "OPTIONS": {"connect_timeout": 2},
        },
    )
    with django_db_blocker.unblock():
        yield alias
        drop_alias(alias)


def test_unreachable_database_is_store_unavailable(down_alias: str) -> None:
    """A database that refuses connections raises StoreUnavailable naming the store."""
    store = DjangoStore(down_alias)
    with pytest.raises(StoreUnavailable, match="django-db") as excinfo:
        store.acquire("p:k", "a", 10, META)
    assert excinfo.value.store == "django-db"
    with pytest.raises(StoreUnavailable):
        store.release("p:k", "a")


def test_unreachable_store_falls_back_open(down_alias: str, celery_app: Any) -> None:
    """With the lock database down, dedup_fallback='open' publishes without a lock, and says so."""
    from django.test import override_settings

    from celery_dedup.signals import dedup_fallback

    seen: list[dict[str, Any]] = []

    def on_fallback(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    dedup_fallback.connect(on_fallback, weak=False)
    from shop.tasks import sync_address

    from celery_dedup.runtime import reset_runtime

    with override_settings(CELERY_DEDUP_STORE=f"django-db://{down_alias}"):
        reset_runtime(celery_app)
        sync_address._dedup_config = None
        try:
            first = sync_address.delay(1, {"zip": "1"})
            second = sync_address.delay(1, {"zip": "1"})
        finally:
            dedup_fallback.disconnect(on_fallback)
    assert first.id != second.id and not second.deduplicated
    assert [(k["reason"], k["action"]) for k in seen] == [("unavailable", "open")] * 2
    assert all(isinstance(k["error"], StoreUnavailable) for k in seen)
