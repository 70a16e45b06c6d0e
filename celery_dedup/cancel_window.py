"""A cancel signal raises in the body it was meant for, never after it.

``cancel_running`` (and a revoke with ``terminate=True``) ends a running body
in a prefork pool child with ``SIGUSR1``: billiard's soft time limit handler
raises ``SoftTimeLimitExceeded`` wherever the child is when the signal
lands. A body that ended just before is no longer there: the exception then
breaks off whatever the child does next, such as a Redis command of the
result backend or of the lock store half read, and that connection goes
back to its pool one reply behind: every later task of that child reads
another command's reply (``DecodeError``) and never stores its result.

So once a ``DedupTask`` body has returned or raised, the child's handler
swallows the signal until the next task starts (``task_prerun``); during
bodies, and for every task that is not a ``DedupTask``, billiard's handler
runs as before. Only a prefork child's main thread is touched, and only
while billiard's own handler is installed.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from celery.signals import task_prerun

__all__ = ["body_ended"]

logger = logging.getLogger("celery_dedup")

#: billiard's soft time limit signal (absent on platforms without SIGUSR1)
_SIGNAL = getattr(signal, "SIGUSR1", None)


class _Window:
    """The handler this process installed, and whether a body just ended."""

    def __init__(self) -> None:
        #: billiard's handler, while ours stands in for it
        self.billiard: Any = None
        self.closed = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.closed:
            logger.info(
                "celery-dedup: a cancel signal arrived after its body had ended; ignored"
            )
            return
        self.billiard(signum, frame)


_window = _Window()


def _billiard_handler() -> Any:
    try:
        from billiard.pool import soft_timeout_sighandler
    except ImportError:  # pragma: no cover - billiard ships with Celery
        return None
    return soft_timeout_sighandler


def body_ended() -> None:
    """A ``DedupTask`` body returned or raised: hold off the cancel signal until the next task."""
    if _SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return
    if _window.billiard is None:
        current = signal.getsignal(_SIGNAL)
        if current is not _billiard_handler():
            return  # not a prefork pool child (or another handler stands there)
        _window.billiard = current
        signal.signal(_SIGNAL, _window.handler)
    _window.closed = True


@task_prerun.connect(weak=False)
def _reopen(**_: Any) -> None:
    """The next task of this process starts: a cancel signal raises again."""
    _window.closed = False
