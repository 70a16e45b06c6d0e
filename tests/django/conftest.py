"""Fixtures of the Django session: the example's Celery app, a real worker, Postgres.

Run with ``python -m pytest -p django --ds=tests.django.settings tests/django``.

PostgreSQL: its port is known only once the ``postgres_server`` session
fixture has started it, long after pytest-django set Django up. So
``pg_alias`` adds the ``DATABASES`` alias ``dedup_pg`` at run time (in
``settings.DATABASES`` and ``connections.settings``, with Django's defaults
filled in by ``connections.configure_settings``), migrates it, and tests reach
it through ``django_db_blocker.unblock()`` rather than pytest-django's test
databases, which are created before any fixture runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from django.core.management import call_command
from django.db import connections

from celery_dedup.runtime import reset_runtime
from celery_dedup.stores.django import DjangoStore
from tests.fixtures._store_case import StoreCase

PG_ALIAS = "dedup_pg"
PG_DATABASE = "celery_dedup_django"


@pytest.fixture
def celery_app() -> Iterator[Any]:
    """The example project's Celery app, with celery-dedup's per-app state reset."""
    from example_project.celery import app

    reset_runtime(app)
    _purge_queue(app)
    yield app
    reset_runtime(app)


def _purge_queue(app: Any) -> None:
    """Drop messages earlier tests published without a worker (``memory://`` is per process)."""
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(app.conf.task_default_queue)


@pytest.fixture
def worker(celery_app: Any, transactional_db: None) -> Iterator[Any]:
    """A real Celery worker (solo pool, in a thread) sharing the test's SQLite file."""
    with start_worker(
        celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=30
    ) as controller:
        yield controller


@pytest.fixture
def lock_store(celery_app: Any, transactional_db: None) -> DjangoStore:
    """The store the example app uses under the test settings (django-db on SQLite)."""
    from celery_dedup.runtime import runtime_for

    store = runtime_for(celery_app).store
    assert isinstance(store, DjangoStore)
    return store


def _flush(alias: str) -> None:
    from celery_dedup.contrib.django.models import DedupCounter, DedupGateWaiter, DedupLock

    DedupLock.all_rows.using(alias).all().delete()
    DedupGateWaiter.objects.using(alias).all().delete()
    DedupCounter.objects.using(alias).all().delete()


@pytest.fixture
def store_django_sqlite(transactional_db: None) -> Iterator[StoreCase]:
    """The Django DB store on the SQLite test database (committed, visible to threads)."""
    _flush("default")
    yield StoreCase(url="django-db", store=DjangoStore("default"), flush=lambda: _flush("default"))
    _flush("default")


@pytest.fixture(scope="session")
def pg_alias(postgres_server: Any, django_db_blocker: Any) -> Iterator[str]:
    """A ``DATABASES`` alias on the session's PostgreSQL, added at run time and migrated."""
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {PG_DATABASE}")
        conn.execute(f"CREATE DATABASE {PG_DATABASE}")
    config = connections.configure_settings(
        {
            **connections.settings,
            PG_ALIAS: {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": PG_DATABASE,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": str(postgres_server.port),
            }
        }
    )[PG_ALIAS]
    settings.DATABASES[PG_ALIAS] = config
    connections.settings[PG_ALIAS] = config
    with django_db_blocker.unblock():
        call_command("migrate", database=PG_ALIAS, verbosity=0)
    yield PG_ALIAS
    with django_db_blocker.unblock():
        connections.close_all()
    del connections.settings[PG_ALIAS]
    settings.DATABASES.pop(PG_ALIAS, None)


@pytest.fixture
def store_django_postgres(pg_alias: str, django_db_blocker: Any) -> Iterator[StoreCase]:
    """The Django DB store on PostgreSQL (``django-db://dedup_pg``)."""
    with django_db_blocker.unblock():
        _flush(pg_alias)
        yield StoreCase(
            url=f"django-db://{pg_alias}",
            store=DjangoStore(pg_alias),
            flush=lambda: _flush(pg_alias),
        )
        _flush(pg_alias)
