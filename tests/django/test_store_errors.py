"""The Django DB store on a PostgreSQL that refuses: typed store errors only.

The same check as ``tests/stores/test_store_errors.py``, through Django's
database wrappers: a read-only session (``default_transaction_read_only``,
as on a standby after a failover) and a role without rights on the tables.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connections

from celery_dedup.exceptions import StorePermissionDenied, StoreRefused
from celery_dedup.stores.django import DjangoStore
from tests.django.conftest import PG_DATABASE, _flush
from tests.fixtures.failing_stores import ALL, HELD, META, OWNER, WRITES, Broken, check_operations

pytestmark = pytest.mark.postgres


def _alias(alias: str, pg_alias: str, **changes: Any) -> DjangoStore:
    """A ``DATABASES`` alias like ``pg_alias`` with ``changes``, and a store on it."""
    keys = ("ENGINE", "NAME", "USER", "HOST", "PORT")
    base = {key: settings.DATABASES[pg_alias][key] for key in keys}
    config = connections.configure_settings({**connections.settings, alias: {**base, **changes}})
    settings.DATABASES[alias] = connections.settings[alias] = config[alias]
    return DjangoStore(alias)


def _forget(store: DjangoStore) -> None:
    queries = getattr(store._local, "queries", None)
    if queries is not None:
        queries.connection.close()
    connections[store.using].close()
    del connections.settings[store.using]
    settings.DATABASES.pop(store.using, None)


@pytest.fixture
def held(pg_alias: str, django_db_blocker: Any) -> Iterator[str]:
    """``HELD`` written on the migrated PostgreSQL database, by its owner."""
    with django_db_blocker.unblock():
        _flush(pg_alias)
        assert DjangoStore(pg_alias).acquire(HELD, OWNER, 300, META) is None
        yield pg_alias
        _flush(pg_alias)


@pytest.fixture
def django_read_only(held: str, django_db_blocker: Any) -> Iterator[Broken]:
    """Read-only sessions: every write answers 25006."""
    with django_db_blocker.unblock():
        store = _alias(
            "dedup_read_only", held, OPTIONS={"options": "-c default_transaction_read_only=on"}
        )
        try:
            yield Broken(store, r"read-only transaction \(SQLSTATE 25006\)", store.label)
        finally:
            _forget(store)


@pytest.fixture
def django_no_rights(held: str, postgres_server: Any, django_db_blocker: Any) -> Iterator[Broken]:
    """A role without any privilege on the lock tables: 42501."""
    role = f"norights_{uuid.uuid4().hex[:10]}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    with django_db_blocker.unblock():
        store = _alias("dedup_no_rights", held, USER=role)
        try:
            yield Broken(store, "permission denied for table", store.label)
        finally:
            _forget(store)
            with postgres_server.connect() as conn:
                conn.execute(f"DROP ROLE IF EXISTS {role}")


def test_read_only_database(django_read_only: Broken) -> None:
    """Reads still answer; every write is StoreRefused naming 25006."""
    assert settings.DATABASES["dedup_read_only"]["NAME"] == PG_DATABASE
    check_operations(django_read_only, StoreRefused, WRITES)


def test_role_without_rights(django_no_rights: Broken) -> None:
    """Every operation is StorePermissionDenied, and says how to fix it."""
    check_operations(django_no_rights, StorePermissionDenied, ALL)
    with pytest.raises(StorePermissionDenied, match="migrate celery_dedup"):
        django_no_rights.store.get(HELD)
