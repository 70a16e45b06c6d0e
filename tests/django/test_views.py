"""The example's API views, through Django's test client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client


@pytest.fixture
def client_(celery_app: Any, transactional_db: None) -> Client:
    """A test client; the app's locks live in the test database."""
    return Client()


def _post(client: Client, url: str, body: Any, **headers: str) -> Any:
    return client.post(url, json.dumps(body), content_type="application/json", headers=headers)


def test_payment_created_then_conflict(client_: Client) -> None:
    """The first POST /payments/ is 201; the same payment again is 409 without the holder id."""
    body = {"payment_id": "pay-1", "amount": "19.99", "currency": "EUR"}
    first = _post(client_, "/payments/", body)
    assert first.status_code == 201
    holder_id = first.json()["task_id"]
    second = _post(client_, "/payments/", body)
    assert second.status_code == 409
    data = second.json()
    assert "already enqueued" in data["error"] and 0 < data["retry_after"] <= 24 * 3600
    assert holder_id not in second.content.decode()


def test_other_payment_is_not_a_conflict(client_: Client) -> None:
    """A different payment id is different work: 201 again."""
    for payment_id in ("a", "b"):
        body = {"payment_id": payment_id, "amount": "1", "currency": "EUR"}
        assert _post(client_, "/payments/", body).status_code == 201


def test_payment_bad_body_is_400(client_: Client) -> None:
    """A body without the required fields is refused before anything is queued."""
    assert _post(client_, "/payments/", {"payment_id": "x"}).status_code == 400
    bad = client_.post("/payments/", "not json", content_type="application/json")
    assert bad.status_code == 400


def test_payments_only_accept_post(client_: Client) -> None:
    """GET /payments/ is 405."""
    assert client_.get("/payments/").status_code == 405


def test_order_without_idempotency_key_is_400(client_: Client) -> None:
    """POST /orders/ without an Idempotency-Key header is 400 and queues nothing."""
    response = _post(client_, "/orders/", {"order_id": 7, "items": ["book"]})
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]


def test_order_with_key_is_202_and_idempotent(client_: Client) -> None:
    """The same Idempotency-Key gets 202 and the first request's task id; a new key a new task."""
    body = {"order_id": 7, "items": ["book"]}
    first = _post(client_, "/orders/", body, **{"Idempotency-Key": "k-1"})
    again = _post(client_, "/orders/", body, **{"Idempotency-Key": "k-1"})
    other = _post(client_, "/orders/", body, **{"Idempotency-Key": "k-2"})
    assert (first.status_code, again.status_code, other.status_code) == (202, 202, 202)
    assert first.json()["deduplicated"] is False and again.json()["deduplicated"] is True
    assert again.json()["task_id"] == first.json()["task_id"] != other.json()["task_id"]


def test_order_key_reused_for_another_order_is_422(client_: Client) -> None:
    """The same Idempotency-Key with a different order: 422, nothing queued, no holder id."""
    key = {"Idempotency-Key": "k-3"}
    first = _post(client_, "/orders/", {"order_id": 8, "items": ["book"]}, **key)
    other = _post(client_, "/orders/", {"order_id": 8, "items": ["pen"]}, **key)
    assert (first.status_code, other.status_code) == (202, 422)
    assert "different arguments" in other.json()["error"]
    assert first.json()["task_id"] not in other.content.decode()
