"""Flower shows deduplicated calls with only the settings Flower itself needs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from tests.apps.cli_app import SLOW, make_app
from tests.fixtures.flower import FlowerServer

pytestmark = [pytest.mark.flower, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def app(flower: FlowerServer, redis_url: str) -> Iterator[Celery]:
    """Events on as Flower's docs ask (``worker_send_task_events``), nothing else."""
    app = make_app(flower.broker_url, redis_url, worker_send_task_events=True)
    yield app
    app.close()


def test_duplicate_row_without_task_send_sent_event(app: Celery, flower: FlowerServer) -> None:
    """No ``task_send_sent_event``, no ``dedup_send_events``: the DEDUPLICATED row appears."""
    assert not app.conf.task_send_sent_event and app.conf.get("dedup_send_events") is None
    slow = app.tasks[SLOW]
    holder = slow.delay(0.5, tag="defaults")
    duplicate = slow.delay(0.5, tag="defaults")
    assert duplicate.deduplicated is True and duplicate.id == holder.id
    row = flower.wait_for(lambda: flower.task(duplicate.duplicate_id),
                          what="the DEDUPLICATED row")
    assert row["state"] == "DEDUPLICATED" and row["parent_id"] == holder.id
