"""``task-deduplicated`` events for Flower and other event consumers.

Each suppressed call is reported under its own never-published uuid with
``parent_id`` set to the holder, from a dispatcher with a stable hostname;
an event is never sent under the holder's uuid, which would overwrite the
holder's state and worker in Flower.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any, Final

from celery.utils.saferepr import saferepr

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["EVENT_TYPE", "dispatcher_hostname", "send_deduplicated"]

logger = logging.getLogger("celery_dedup")

EVENT_TYPE: Final = "task-deduplicated"


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

    Costs one broker publish; failures are logged, never raised, since the
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
                result=f"suppressed: duplicate of {holder_id}",
            )
    except Exception:
        logger.warning("celery-dedup: could not send a %s event", EVENT_TYPE, exc_info=True)
