"""Task events for Flower and other event consumers.

* ``task-deduplicated``: each suppressed call is reported under its own
  never-published uuid with ``parent_id`` set to the holder and
  ``received`` set to the time of the call. An event is never sent under the
  holder's uuid, which would overwrite the holder's state and worker in
  Flower. Flower shows it as state ``DEDUPLICATED``. Celery's event state
  (and so Flower) registers a worker for the hostname of every task event
  other than ``task-sent``, and nothing a sender can send removes it (a
  ``worker-offline`` only marks it offline, and sets Flower's
  ``flower_worker_online`` gauge to 0, which offline-worker alerts watch).
  So a call made by a task running in a worker is reported from that
  worker's own hostname (no row of its own), and a call made anywhere else
  from the stable ``celery-dedup@<host>``, with no ``worker-offline``.
* ``task-ignored``: a task the worker skipped because another task holds its
  lock (``task_skipped``) is reported under its own uuid from the worker's
  hostname, so Flower shows it as ``IGNORED`` (the state the result backend
  has) instead of leaving it ``STARTED`` forever. A message skipped because
  its owner was revoked (``replace``, ``cancel_running``, ``revoke()``) gets
  Celery's own ``task-revoked`` instead (state ``REVOKED``).

* ``task-replaced`` and ``task-cancelled``: a published message that a
  policy displaced: replaced by ``on_duplicate="replace"`` (``policy``
  ``"replace"``, or ``"replace+max_wait"`` when ``debounce_max_wait``
  capped the new call), or cancelled by ``on_duplicate="cancel_running"``
  (queued: revoked; running: terminated). Sent under the displaced
  message's own uuid, which no longer holds the key: Flower shows it as
  ``REPLACED`` or ``CANCELLED`` with ``result`` naming the new call and the
  policy. A cancelled body that still returns ends ``SUCCESS`` (a higher
  state). With a deterministic task id the new message has the same uuid, so
  the event is sent under a fresh uuid whose ``parent_id`` is that id.
* ``task-deduplicated`` carries ``policy`` (a custom field; Flower shows the
  ``result`` text, which names it): the call's ``on_duplicate``,
  ``"on_key_reuse=warn"`` for a reused key answered as a duplicate,
  ``"on_key_reuse=raise"`` for one refused with ``KeyReuseError`` (sent
  under a fresh uuid, without arguments), ``"on_commit"`` for a Django
  ``delay_on_commit`` call folded into an identical one of its transaction
  (sent at commit, child of the message the transaction published).
* ``task-rate-limited``: a call refused by ``rate_limit_per_key`` (not
  published) under its own never-published uuid, with ``retry_after`` and
  a ``result`` saying so; Flower shows it as state ``RATE-LIMITED``. It
  never names another call as its parent: a refused call is different
  work, not a duplicate of the last publish.

* ``task-observed``: under ``dedup_mode="observe"``, a call enforcing would
  have suppressed, refused by its rate, or used to replace or cancel a
  holder, published anyway. Sent under a fresh uuid (the published call has
  its own events) with ``parent_id`` the holder, ``published_id`` the call
  that runs, ``would`` and ``policy``; Flower shows it as state ``OBSERVED``.

All of them are sent when ``dedup_send_events`` is on. Unset, it is on when the
app's configuration turns Celery's task events on for Flower
(``worker_send_task_events`` or ``task_send_sent_event``): a project whose
settings make Flower show tasks shows its deduplicated calls too, without a
setting of its own. ``task-ignored`` is also sent by a worker started with
``-E``. Events are not on by default otherwise: each suppressed call would
cost a broker publish, for nothing when no monitor listens (on Redis the
events are then dropped). A worker started with ``-E`` whose configuration
leaves them off says so in its log at start (``W_EVENTS_OFF``). Events are
silently dropped on the ``sqla`` broker.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Final

from celery._state import get_current_worker_task
from celery.utils import uuid as gen_uuid
from celery.utils.saferepr import saferepr

from .signals import holder_cancelled, key_reused, lock_replaced, task_skipped

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["CANCELLED_EVENT_TYPE", "DEFERRED_EVENT_TYPE", "EVENT_TYPE", "OBSERVED_EVENT_TYPE",
           "RATE_LIMITED_EVENT_TYPE",
           "REPLACED_EVENT_TYPE",
           "SKIPPED_EVENT_TYPE", "W_EVENTS_OFF", "default_send_events", "dispatcher_hostname",
           "send_deduplicated", "send_displaced", "send_observed", "send_rate_limited",
           "send_skipped",
           "sender_hostname",
           "warn_if_events_off"]

logger = logging.getLogger("celery_dedup")

EVENT_TYPE: Final = "task-deduplicated"

#: the event a worker-side skip is reported with (Flower state ``IGNORED``)
SKIPPED_EVENT_TYPE: Final = "task-ignored"

#: the event of a message a worker deferred (published again for later):
#: Flower shows its state as ``DEFERRED`` until the copy's own events
DEFERRED_EVENT_TYPE: Final = "task-deferred"

#: Celery's event of a revoked task: a skipped message whose owner was revoked
REVOKED_EVENT_TYPE: Final = "task-revoked"

#: the event of a message ``on_duplicate="replace"`` displaced (Flower state ``REPLACED``)
REPLACED_EVENT_TYPE: Final = "task-replaced"

#: the event of a holder ``on_duplicate="cancel_running"`` cancelled (state ``CANCELLED``)
CANCELLED_EVENT_TYPE: Final = "task-cancelled"

#: the event of a call ``rate_limit_per_key`` refused (Flower state ``RATE-LIMITED``)
RATE_LIMITED_EVENT_TYPE: Final = "task-rate-limited"

#: the event of a call ``dedup_mode="observe"`` published anyway (Flower state ``OBSERVED``)
OBSERVED_EVENT_TYPE: Final = "task-observed"


W_EVENTS_OFF = (
    "celery-dedup: this worker sends task events (-E), but deduplicated calls are "
    "not reported: Flower and other monitors will show no DEDUPLICATED rows. Set "
    "dedup_send_events=True (Django: CELERY_DEDUP_SEND_EVENTS = True), or "
    "worker_send_task_events=True, in the configuration the producers read (each "
    "suppressed call then costs a broker publish)."
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
    policy: str = "",
    result: str | None = None,
) -> None:
    """Emit one ``task-deduplicated`` event for a suppressed call.

    ``policy`` is what decided (see the module's docstring), ``result`` the
    text Flower shows (default ``"suppressed: duplicate of <holder>"``, with
    the policy when it is not a plain duplicate's). Costs one small broker
    publish; failures are logged, never raised, since the call itself has
    already been decided.
    """
    if result is None:
        result = f"suppressed: duplicate of {holder_id}"
        if policy.startswith("on_"):
            result += f" ({policy})"
    fields: dict[str, Any] = {"policy": policy} if policy else {}
    if holder_id:
        fields.update(parent_id=holder_id, root_id=root_id or holder_id)
    _send_from_producer(
        app,
        EVENT_TYPE,
        uuid=duplicate_id,
        name=task_name,
        args=saferepr(args or ()),
        kwargs=saferepr(kwargs or {}),
        received=time.time(),
        result=result,
        **fields,
    )


def send_displaced(
    app: Celery,
    event_type: str,
    *,
    task_name: str,
    displaced_id: str,
    new_id: str,
    policy: str,
    running: bool = False,
) -> None:
    """Emit one ``task-replaced``/``task-cancelled`` event for a message a policy displaced.

    Under the displaced message's uuid, or a fresh one (child of ``new_id``)
    when the new message has the same id. One small broker publish, as
    ``send_deduplicated``; failures are logged, never raised.
    """
    if event_type == CANCELLED_EVENT_TYPE:
        verb = "terminated" if running else "revoked"
        result = f"cancelled ({verb}) by {new_id} ({policy})"
    else:
        result = f"replaced by {new_id} ({policy})"
    fields: dict[str, Any] = {}
    uuid = displaced_id
    if displaced_id == new_id:
        uuid = gen_uuid()
        fields.update(parent_id=new_id, root_id=new_id)
    _send_from_producer(
        app, event_type, uuid=uuid, name=task_name, policy=policy, new_task_id=new_id,
        running=running, result=result, **fields,
    )


def send_rate_limited(
    app: Celery,
    *,
    task_name: str,
    task_id: str,
    args: Any,
    kwargs: Any,
    retry_after: float,
    policy: str,
) -> None:
    """Emit one ``task-rate-limited`` event for a call refused by its rate limit.

    Under the refused call's own uuid (never published); one small broker
    publish, as ``send_deduplicated``; failures are logged, never raised.
    """
    _send_from_producer(
        app,
        RATE_LIMITED_EVENT_TYPE,
        uuid=task_id,
        name=task_name,
        args=saferepr(args or ()),
        kwargs=saferepr(kwargs or {}),
        received=time.time(),
        retry_after=round(retry_after, 3),
        policy=policy,
        result=f"refused: over rate_limit_per_key, retry in {retry_after:.1f}s ({policy})",
    )


def send_observed(
    app: Celery,
    *,
    task_name: str,
    task_id: str,
    holder_id: str | None,
    would: str,
    policy: str,
    args: Any,
    kwargs: Any,
) -> None:
    """Emit one ``task-observed`` event for a call ``dedup_mode="observe"`` published anyway.

    Under a fresh uuid, never the published call's own (its events show
    its run; an event of ours under its uuid would overwrite its state and
    worker in Flower), with ``parent_id`` the key's holder when there is
    one, so Flower lists the observed calls under the holder's children as
    it lists suppressed ones. ``published_id`` names the call that ran.
    """
    fields: dict[str, Any] = {}
    if holder_id is not None:
        fields["parent_id"] = holder_id
    of = f" of {holder_id}" if holder_id is not None else ""
    _send_from_producer(
        app,
        OBSERVED_EVENT_TYPE,
        uuid=gen_uuid(),
        name=task_name,
        args=saferepr(args or ()),
        kwargs=saferepr(kwargs or {}),
        received=time.time(),
        published_id=task_id,
        would=would,
        policy=policy,
        result=f"observed: would {would.replace('_', ' ')}{of} ({policy}); published as {task_id}",
        **fields,
    )


def sender_hostname() -> str:
    """The hostname the producer's events are sent under.

    The worker's own node name when the call is made by a task a worker is
    running (Flower already lists that worker), else ``celery-dedup@<host>``.
    """
    task = get_current_worker_task()
    hostname = getattr(getattr(task, "request", None), "hostname", None)
    return hostname if isinstance(hostname, str) and hostname else dispatcher_hostname()


def _send_from_producer(app: Celery, event_type: str, **fields: Any) -> None:
    """Send one task event from the calling worker's hostname, else the stable one."""
    try:
        with app.events.default_dispatcher(hostname=sender_hostname()) as dispatcher:
            dispatcher.send(event_type, **fields)
    except Exception:
        logger.warning("celery-dedup: could not send a %s event", event_type, exc_info=True)


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
    are logged, never raised. A revoked one (replaced, cancelled, revoked)
    gets Celery's ``task-revoked`` instead: state ``REVOKED``. A deferred
    message (``reason`` ``"deferred: …"``) is not skipped but put back for
    later: it gets a ``task-deferred`` event instead, which Flower shows as
    state ``DEFERRED`` (never failed).
    """
    deferred = reason.startswith("deferred")
    try:
        with app.events.default_dispatcher(hostname=hostname or dispatcher_hostname()) as d:
            if reason == "revoked":
                # Celery's own event, as for any revoke: state REVOKED (as the
                # result backend says), ranked below the REPLACED or
                # CANCELLED a policy's event set, so that stays visible.
                d.send(REVOKED_EVENT_TYPE, uuid=task_id, name=task_name, terminated=False,
                       signum=None, expired=False)
                return
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


def _producer_events_on(sender: Any) -> bool:
    """Whether ``sender`` (a ``DedupTask``) reports its policies' actions as events."""
    config = getattr(sender, "dedup_config", None)
    return config is not None and bool(config().runtime.settings.send_events)


@lock_replaced.connect(weak=False)
def _report_replaced(
    sender: Any = None,
    task_id: str | None = None,
    previous_task_id: str | None = None,
    policy: str = "replace",
    follow_up: bool = False,
    **_: Any,
) -> None:
    """``lock_replaced`` receiver: a ``task-replaced`` event for the displaced message.

    None for a ``keep_last`` follow-up: the holder it follows runs on to its end.
    """
    if task_id and previous_task_id and not follow_up and _producer_events_on(sender):
        send_displaced(
            sender.app, REPLACED_EVENT_TYPE, task_name=sender.name,
            displaced_id=previous_task_id, new_id=task_id, policy=policy,
        )


@holder_cancelled.connect(weak=False)
def _report_cancelled(
    sender: Any = None,
    task_id: str | None = None,
    cancelled_task_id: str | None = None,
    running: bool = False,
    policy: str = "cancel_running",
    **_: Any,
) -> None:
    """``holder_cancelled`` receiver: a ``task-cancelled`` event for the cancelled holder."""
    if task_id and cancelled_task_id and _producer_events_on(sender):
        send_displaced(
            sender.app, CANCELLED_EVENT_TYPE, task_name=sender.name,
            displaced_id=cancelled_task_id, new_id=task_id, policy=policy, running=running,
        )


@key_reused.connect(weak=False)
def _report_refused_reuse(
    sender: Any = None, existing_task_id: str = "", action: str = "", **_: Any
) -> None:
    """``key_reused`` receiver: a call refused with ``KeyReuseError`` gets its row.

    (A reused key answered as a duplicate, ``"warn"``, is reported by its
    ``task-deduplicated`` event, whose policy says so.)
    """
    if action != "raise" or not _producer_events_on(sender):
        return
    holder = existing_task_id or "a call pending in this transaction"
    send_deduplicated(
        sender.app,
        task_name=sender.name,
        duplicate_id=gen_uuid(),
        holder_id=existing_task_id,
        args=None,
        kwargs=None,
        policy="on_key_reuse=raise",
        result=f"refused: key of {holder} reused with different arguments (on_key_reuse=raise)",
    )
