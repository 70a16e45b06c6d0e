"""OpenTelemetry: celery-dedup's decisions on the spans of ``opentelemetry-instrumentation-celery``.

When the ``CeleryInstrumentor`` is instrumented, every decision celery-dedup
takes shows in the trace, under attributes named ``celery_dedup.*``:

* a **published** call (``outcome="published"``, or ``"deferred"`` when
  ``on_rate_limit="delay"`` gave it a countdown): on the instrumentor's
  ``apply_async/<task>`` publish span;
* a **duplicate** (``"duplicate"``, with ``celery_dedup.holder_id``) or a
  call **refused** by its rate (``"refused"``): nothing is published, so
  the instrumentor has no span; celery-dedup records one of its own, named
  ``apply_async/<task>`` like a publish span, a child of the caller's span;
* a delivered message the worker did not run (``"skipped"``: replaced,
  held by another publish, revoked, already ran; ``"deferred"``: published
  again for later): on the instrumentor's ``run/<task>`` span, with an
  event ``celery_dedup.skipped`` or ``celery_dedup.deferred`` carrying
  the reason.

Keys appear as their digest (``celery_dedup.key_digest``), never as the
raw key or the arguments. The wiring is celery-dedup's own signals and
Celery's publish signals; OpenTelemetry is imported lazily, on the first
decision, so the package works without it (``pip install
celery-dedup[otel]`` brings the API; the instrumentation is the app's).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

from celery.signals import after_task_publish, before_task_publish

from .signals import task_skipped

if TYPE_CHECKING:
    from .admission.state import Admission

logger = logging.getLogger("celery_dedup")

__all__ = ["ATTRIBUTE_PREFIX", "active", "decided", "failed", "publishing"]

#: every attribute celery-dedup sets starts with this
ATTRIBUTE_PREFIX: Final = "celery_dedup."
#: the tracer celery-dedup's own spans are recorded by
TRACER_NAME: Final = "celery_dedup"
#: decisions waiting for their publish span, per thread (a publish that never
#: happened, e.g. it raised before Celery's signal, is forgotten past this many)
_PENDING_MAX: Final = 64

_pending = threading.local()
#: the ``CeleryInstrumentor`` singleton once looked up (``False``: OpenTelemetry's
#: Celery instrumentation is not installed)
_found: dict[str, Any] = {}


def _lookup() -> Any:
    if "instrumentor" not in _found:
        try:
            from opentelemetry.instrumentation import celery as instrumentation
        except ImportError:
            _found["instrumentor"] = False
        else:
            # (untyped; the instrumentor is a singleton)
            make: Any = instrumentation.CeleryInstrumentor
            _found["instrumentor"] = make()
    return _found["instrumentor"]


def active() -> bool:
    """Whether ``opentelemetry-instrumentation-celery`` is installed and instrumented."""
    instrumentor = _lookup()
    return bool(instrumentor) and bool(instrumentor.is_instrumented_by_opentelemetry)


def digest(key: str) -> str:
    """The part of a store key that names the call: its SHA-256 digest, never raw material."""
    return key.rsplit(":", 1)[-1]


def _attributes(adm: Admission, outcome: str, **extra: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "outcome": outcome,
        "task": adm.task.name,
        "policy": adm.policy or adm.call.on_duplicate.value,
        "unique_until": adm.call.unique_until.value,
    }
    if adm.key is not None:
        attributes["key_digest"] = digest(adm.key)
    attributes.update({name: value for name, value in extra.items() if value is not None})
    return {ATTRIBUTE_PREFIX + name: value for name, value in attributes.items()}


def publishing(adm: Admission) -> None:
    """A call is about to be published: its decision goes on the instrumentor's publish span."""
    if not active():
        return
    previous = adm.previous.task_id if adm.previous is not None else None
    cancelled = adm.cancelled.task_id if adm.cancelled is not None else None
    outcome = "deferred" if adm.notes.get("rate_place") is not None else "published"
    pending = _waiting()
    # An observed call (``dedup_mode="observe"``) says what enforcing would have done.
    attributes = _attributes(
        adm, outcome, replaced_task_id=previous, cancelled_task_id=cancelled,
        would=adm.notes.get("observed"),
        # published without a lock: the store did not answer (``dedup_fallback``)
        fallback=adm.notes.get("fallback"),
    )
    pending[adm.task_id] = (adm.task, attributes)
    while len(pending) > _PENDING_MAX:
        pending.popitem(last=False)


def decided(adm: Admission, outcome: str, **extra: Any) -> None:
    """A call that publishes nothing (``duplicate``, ``refused``): a span of its own."""
    if not active():
        return
    from opentelemetry import trace

    tracer = trace.get_tracer(TRACER_NAME)
    attributes = _attributes(adm, outcome, **extra)
    with tracer.start_as_current_span(
        f"apply_async/{adm.task.name}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        pass


def failed(adm: Admission, error: BaseException) -> None:
    """A publish that raised: no span may say ``published``; one says ``failed``, with the error.

    The instrumentor ends its publish span in ``after_task_publish``, which
    a failed publish never sends: its span would stay open, and current in
    this thread's context. It is ended here as the instrumentor's own
    activation would end it on an error, and detached. Never raises: it
    runs while the publish's own error propagates, which must reach the
    caller unchanged.
    """
    if not active():
        return
    try:
        _end_failed(adm, error)
    except Exception:
        logger.warning("celery-dedup: could not end the failed publish's span", exc_info=True)


def _end_failed(adm: Admission, error: BaseException) -> None:
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import utils

    pending = getattr(_pending, "calls", None)
    if pending is not None:
        pending.pop(adm.task_id, None)
    attributes = _attributes(adm, "failed", error=type(error).__name__)
    found = utils.retrieve_context(adm.task, adm.task_id, is_publish=True)
    if found is not None:
        span, activation, _ = found
        span.set_attributes(attributes)
        utils.detach_context(adm.task, adm.task_id, is_publish=True)
        if activation is not None:
            activation.__exit__(type(error), error, error.__traceback__)
        return
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"apply_async/{adm.task.name}", kind=trace.SpanKind.PRODUCER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))


def _waiting() -> OrderedDict[str, tuple[Any, dict[str, Any]]]:
    pending: OrderedDict[str, tuple[Any, dict[str, Any]]] | None = getattr(
        _pending, "calls", None
    )
    if pending is None:
        pending = _pending.calls = OrderedDict()
    return pending


def _publish_span(task: Any, task_id: str, is_publish: bool) -> Any:
    """The instrumentor's open span of ``task_id`` (publish or run), or ``None``."""
    from opentelemetry.instrumentation.celery import utils

    found = utils.retrieve_context(task, task_id, is_publish=is_publish)
    return None if found is None else found[0]


def _annotate_publish(headers: Any, *, last: bool) -> None:
    """Put a pending decision on the instrumentor's open publish span, if it is open now.

    Receivers run in the order they connected: ours may run before the
    instrumentor's ``before_task_publish`` opened its span; it is still
    open in ``after_task_publish`` then, before the instrumentor ends it.
    After the publish the decision is dropped, found or not (a task the
    instrumentor could not look up in the current app has no span).
    """
    pending = getattr(_pending, "calls", None)
    if not pending or not isinstance(headers, dict):
        return
    task_id = headers.get("id")
    entry = pending.get(task_id) if isinstance(task_id, str) else None
    if entry is None:
        return
    task, attributes = entry
    span = _publish_span(task, str(task_id), True)
    if span is not None or last:
        del pending[task_id]
    if span is not None:
        span.set_attributes(attributes)


def _before_publish(headers: Any = None, **_: Any) -> None:
    _annotate_publish(headers, last=False)


def _after_publish(headers: Any = None, **_: Any) -> None:
    _annotate_publish(headers, last=True)


def _annotate_skip(
    sender: Any = None,
    key: str = "",
    task_id: str = "",
    existing_task_id: str | None = None,
    reason: str = "",
    **_: Any,
) -> None:
    """``task_skipped``: the worker span says the body did not run, and why.

    The span is this thread's current run span of the task, the one the
    instrumentor opened for this very delivery: its registry keeps one run
    span per message id, so two deliveries of one id running at once (a
    deferral's copy and a redelivery, on a thread pool) would put one's
    skip on the other's span, a run that ran saying it did not.
    """
    if sender is None or not active():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if getattr(span, "name", None) != f"run/{sender.name}":
        span = _publish_span(sender, str(task_id), False) or span
    if not span.is_recording():
        return
    outcome = "deferred" if reason.startswith("deferred") else "skipped"
    attributes: dict[str, Any] = {
        ATTRIBUTE_PREFIX + "outcome": outcome,
        ATTRIBUTE_PREFIX + "reason": reason,
    }
    if key:
        attributes[ATTRIBUTE_PREFIX + "key_digest"] = digest(key)
    if existing_task_id and existing_task_id != task_id:
        # (a deferred message names itself: it is published again under its id)
        attributes[ATTRIBUTE_PREFIX + "holder_id"] = existing_task_id
    span.set_attributes(attributes)
    span.add_event(ATTRIBUTE_PREFIX + outcome, attributes)


before_task_publish.connect(_before_publish, weak=False, dispatch_uid="celery_dedup.otel.before")
after_task_publish.connect(_after_publish, weak=False, dispatch_uid="celery_dedup.otel.after")
task_skipped.connect(_annotate_skip, weak=False, dispatch_uid="celery_dedup.otel.skipped")
