"""Run a Django store's database work off an asyncio event loop's thread.

Django's ORM raises ``SynchronousOnlyOperation`` on a thread that runs an
event loop (an async view). A plain task's ``delay()`` publishes from there
(a blocking call, as any); a ``DedupTask``'s does too: its store work runs
where Django's own ``sync_to_async(thread_sensitive=True)`` would run it
when there is such a thread (the one an ``async_to_sync`` waits in: async
tests, sync middleware around the view), so it sees that thread's
connection and transaction; else in a helper thread of the store's. The
call blocks the loop until the work is done, as a plain publish does.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["on_event_loop", "run_off_loop"]

T = TypeVar("T")

#: helper threads for loops no sync thread waits for (an ASGI server's)
_HELPERS = 4

_lock = threading.Lock()
#: this process's helper pool, by pid (a forked child makes its own)
_pools: dict[int, ThreadPoolExecutor] = {}


def on_event_loop() -> bool:
    """Whether this thread is running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_off_loop(call: Callable[[], T]) -> T:
    """``call()`` here, or, on an event loop's thread, in a thread Django allows, waited for."""
    if not on_event_loop():
        return call()
    return _executor().submit(call).result()


def _executor() -> Executor:
    from asgiref.sync import AsyncToSync

    waiting: Any = getattr(AsyncToSync.executors, "current", None)
    if waiting is not None:
        return waiting  # type: ignore[no-any-return]
    with _lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = _pools[os.getpid()] = ThreadPoolExecutor(_HELPERS, "celery-dedup-store")
        return pool
