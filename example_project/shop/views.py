"""Two API endpoints that put celery-dedup in front of HTTP clients.

``POST /payments/`` answers 201, or 409 for a payment submitted within the
last 24 hours, queued, running or already charged (``on_duplicate="raise"``;
the message never holds the other task's id). ``POST /orders/`` requires an
``Idempotency-Key`` header: the same key within 24 hours returns the first
request's task, with 202; the same key with a different order is 422
(``on_key_reuse="raise"``, as the IETF idempotency-key draft answers a key
reused for another payload).

The views are not in a transaction (no ``ATOMIC_REQUESTS``), so the lock and
the message exist as soon as the call returns; inside ``atomic()`` use
``transaction.on_commit`` instead (see docs/django.md).
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from celery_dedup import DuplicateTaskError, KeyReuseError

from .tasks import fulfill_order, process_payment


def _body(request: HttpRequest) -> dict[str, Any] | None:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@csrf_exempt
@require_POST
def create_payment(request: HttpRequest) -> JsonResponse:
    """Queue ``process_payment``: 201, 409 for a duplicate, 400 for a bad body."""
    data = _body(request)
    if data is None or not all(data.get(f) for f in ("payment_id", "amount", "currency")):
        return JsonResponse({"error": "payment_id, amount and currency are required"}, status=400)
    try:
        result = process_payment.delay(
            str(data["payment_id"]), str(data["amount"]), str(data["currency"])
        )
    except DuplicateTaskError as exc:
        # str(exc) never contains the holder's task id: safe to show a client.
        return JsonResponse(
            {"error": str(exc), "retry_after": round(exc.ttl or 0)}, status=409
        )
    return JsonResponse({"payment_id": str(data["payment_id"]), "task_id": result.id}, status=201)


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """Queue ``fulfill_order`` under the client's ``Idempotency-Key``: 202, or 400 without one."""
    key = request.headers.get("Idempotency-Key", "").strip()
    if not key:
        return JsonResponse({"error": "the Idempotency-Key header is required"}, status=400)
    data = _body(request)
    if data is None or "order_id" not in data:
        return JsonResponse({"error": "order_id is required"}, status=400)
    try:
        result = fulfill_order.apply_async(
            (data["order_id"], list(data.get("items") or [])),
            deduplication_key=f"order:{key}",
            on_key_reuse="raise",
        )
    except KeyReuseError as exc:
        # Another order under this key: nothing was queued. Safe to show the client.
        return JsonResponse({"error": str(exc)}, status=422)
    return JsonResponse(
        {"task_id": result.id, "deduplicated": bool(result.deduplicated)}, status=202
    )
