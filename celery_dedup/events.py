"""Task events for Flower and other event consumers.

* ``task-deduplicated``: each suppressed call is reported under its own
  never-published uuid with ``parent_id`` set to the holder and
  ``received`` set to the time of the call, from a dispatcher with a stable
  hostname (``celery-dedup@<host>``). An event is never sent under the
  holder's uuid, which would overwrite the holder's state and worker in
  Flower. Flower shows it as state ``DEDUPLICATED``. Celery's event state
  (and so Flower) registers a worker for every hostname a task event comes
  from, so the event is followed by a ``worker-offline`` event for that
  hostname: ``celery-dedup@<host>`` is listed as an offline worker at most,
  never as an online one (Flower's ``--purge_offline_workers`` hides it).
* ``task-ignored``: a task the worker skipped because another task holds its
  lock (``task_skipped``) is reported under its own uuid from the worker's
  hostname, so Flower shows it as ``IGNORED`` (the state the result backend
  has) instead of leaving it ``STARTED`` forever.

Both are sent when ``dedup_send_events`` is on. Unset, it is on when the
app's configuration turns Celery's task events on for Flower
(``worker_send_task_events`` or ``task_send_sent_event``): a project whose
settings make Flower show tasks shows its deduplicated calls too, without a
setting of its own. ``task-ignored`` is also sent by a worker started with
``-E``. Events are not on by default otherwise: each suppressed call would
cost two broker publishes, for nothing when no monitor listens (on Redis the
events are then dropped). A worker started with ``-E`` whose configuration
leaves them off says so in its log at start (``W_EVENTS_OFF``). Events are
silently dropped on the ``sqla`` broker.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Final

from celery.utils.saferepr import saferepr

from .signals import task_skipped

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["DEFERRED_EVENT_TYPE", "EVENT_TYPE", "SKIPPED_EVENT_TYPE", "W_EVENTS_OFF",
           "default_send_events", "dispatcher_hostname", "send_deduplicated", "send_skipped",
           "warn_if_events_off"]

logger = logging.getLogger("celery_dedup")

EVENT_TYPE: Final = "task-deduplicated"

#: the event a worker-side skip is reported with (Flower state ``IGNORED``)
SKIPPED_EVENT_TYPE: Final = "task-ignored"

#: the event of a message a worker deferred (published again for later):
#: Flower shows its state as ``DEFERRED`` until the copy's own events
DEFERRED_EVENT_TYPE: Final = "task-deferred"


W_EVENTS_OFF = (
    "celery-dedup: this worker sends task events (-E), but deduplicated calls are "
    "not reported: Flower and other monitors will show no DEDUPLICATED rows. Set "
    "dedup_send_events=True (Django: CELERY_DEDUP_SEND_EVENTS = True), or "
    "worker_send_task_events=True, in the configuration the producers read (each "
    "suppressed call then costs two broker publishes)."
)


def default_send_events(conf: Any) -> bool:
    """``dedup_send_events`` when unset: on when the configuration turns task events on."""
    return bool(conf.get("worker_send_task_events") or conf.get("task_send_sent_event"))


def warn_if_events_off(worker_sends_events: bool, send_events: bool) -> bool:
    """Log ``W_EVENTS_OFF`` when the worker sends task events but dedup events are off."""
    if worker_sends_events and not send_events:
        logger.warning(W_EVENTS_OFF)
        return True
    return False


def dispatcher_hostname() -> str:
    """The stable hostname events are sent under: ``celery-dedup@<host>``."""
    return f"celery-dedup@{socket.gethostname()}"


def send_deduplicated(
    app: Celery,
    *,
    task_name: str,
    duplicate_id: str,
    holder_id: str,
    args: Any,
    kwargs: Any,
    root_id: str | None = None,
) -> None:
    """Emit one ``task-deduplicated`` event for a suppressed call.

    Costs two small broker publishes (the event, then ``worker-offline`` for
    the dispatcher's hostname); failures are logged, never raised, since the
    call itself has already been decided.
    """
    try:
        with app.events.default_dispatcher(hostname=dispatcher_hostname()) as dispatcher:
            dispatcher.send(
                EVENT_TYPE,
                uuid=duplicate_id,
                name=task_name,
                args=saferepr(args or ()),
                kwargs=saferepr(kwargs or {}),
                parent_id=holder_id,
                root_id=root_id or holder_id,
                received=time.time(),
                result=f"suppressed: duplicate of {holder_id}",
            )
            # Not a worker: withdraw the heartbeat the task event just implied.
            dispatcher.send("worker-offline")
    except Exception:
        logger.warning("celery-dedup: could not send a %s event", EVENT_TYPE, exc_info=True)


def send_skipped(
    app: Celery,
    *,
    task_name: str,
    task_id: str,
    hostname: str | None,
    existing_task_id: str | None,
    reason: str,
) -> None:
    """Emit one ``task-ignored`` event for a task the worker skipped.

    Sent under the skipped task's own id from the worker's hostname; failures
    are logged, never raised. A deferred message (``reason`` ``"deferred: …"``)
    is not skipped but put back for later: it gets a ``task-deferred`` event
    instead, which Flower shows as state ``DEFERRED`` (never failed).
    """
    deferred = reason.startswith("deferred")
    try:
        with app.events.default_dispatcher(hostname=hostname or dispatcher_hostname()) as d:
            d.send(
                DEFERRED_EVENT_TYPE if deferred else SKIPPED_EVENT_TYPE,
                uuid=task_id,
                name=task_name,
                result=(
                    f"{reason}; published again for later"
                    if deferred
                    else f"skipped ({reason}): lock held by {existing_task_id}"
                ),
            )
    except Exception:
        logger.warning(
            "celery-dedup: could not send a %s event", SKIPPED_EVENT_TYPE, exc_info=True
        )


@task_skipped.connect(weak=False)
def _report_skip(
    sender: Any = None,
    task_id: str | None = None,
    existing_task_id: str | None = None,
    reason: str = "",
    **_: Any,
) -> None:
    """``task_skipped`` receiver: report the skip to Flower when events are on."""
    runtime_of = getattr(sender, "dedup_config", None)
    if runtime_of is None or task_id is None:
        return
    app = sender.app
    if not (runtime_of().runtime.settings.send_events or app.conf.worker_send_task_events):
        return
    send_skipped(
        app,
        task_name=sender.name,
        task_id=task_id,
        hostname=getattr(sender.request, "hostname", None),
        existing_task_id=existing_task_id,
        reason=reason,
    )
