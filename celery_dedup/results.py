"""Results returned by ``DedupTask.apply_async``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.app import app_or_default
from celery.result import AsyncResult

from .stores.base import Lock

__all__ = ["DeduplicatedResult", "mark_result", "owner_of"]


if TYPE_CHECKING:
    _AsyncResult = AsyncResult[Any]
else:
    _AsyncResult = AsyncResult


class DeduplicatedResult(_AsyncResult):
    """The holder's ``AsyncResult``, returned when a call was a duplicate.

    ``id`` is the task id of the call that holds the lock, so ``.get()``,
    ``.state`` and ``.revoke()`` act on the task that will actually run.
    """

    #: always True: nothing was published for this call
    deduplicated: bool = True

    def __init__(
        self,
        id: str,
        *,
        deduplication_key: str,
        lock: Lock | None = None,
        duplicate_id: str | None = None,
        backend: Any = None,
        app: Any = None,
        parent: Any = None,
        task_name: str | None = None,  # deprecated in AsyncResult, ignored
    ) -> None:
        # AsyncResult.__init__, but for its ``on_ready`` promise: most
        # duplicate handles are never waited on, so it is built on first use.
        if id is None:
            raise ValueError(f"AsyncResult requires valid id, not {type(id)}")
        self.app = app_or_default(app or self.app)
        self.id = id
        self.backend = backend or self.app.backend
        self.parent = parent
        self._cache = None
        self._ignored = False
        #: the hashed store key the call maps to
        self.deduplication_key = deduplication_key
        #: the holder's lock as the store reported it (owner, expiry, policy)
        self.lock = lock
        #: the id this call would have had (it was never published)
        self.duplicate_id = duplicate_id

    @property
    def on_ready(self) -> Any:
        """The promise fulfilled when the holder's result is ready (built on first use)."""
        promise = self.__dict__.get("_on_ready_promise")
        if promise is None:
            from vine import promise as make_promise

            fulfilled = self._on_fulfilled  # type: ignore[attr-defined]  # untyped in celery
            promise = self.__dict__["_on_ready_promise"] = make_promise(fulfilled, weak=True)
        return promise

    @on_ready.setter
    def on_ready(self, value: Any) -> None:
        self.__dict__["_on_ready_promise"] = value

    def __copy__(self) -> DeduplicatedResult:
        return DeduplicatedResult(
            self.id,
            app=self.app,
            backend=self.backend,
            deduplication_key=self.deduplication_key,
            lock=self.lock,
            duplicate_id=self.duplicate_id,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # AsyncResult pickles its positional arguments; ours are keywords.
        return _unpickle, (self.id, self.deduplication_key, self.lock, self.duplicate_id)

    def __repr__(self) -> str:
        return f"<DeduplicatedResult: {self.id} (duplicate)>"


def _unpickle(
    id: str, deduplication_key: str, lock: Lock | None, duplicate_id: str | None
) -> DeduplicatedResult:
    """A pickled ``DeduplicatedResult`` again, on the current app (as ``AsyncResult``)."""
    return DeduplicatedResult(
        id, deduplication_key=deduplication_key, lock=lock, duplicate_id=duplicate_id
    )


def mark_result(result: Any, key: str | None, owner: str | None = None) -> Any:
    """Tag a published call's result with ``deduplicated=False`` and its key.

    ``owner`` is the publish's owner token, kept privately on the handle so
    ``celery_dedup.revoke``/``release`` given this handle act on this
    publish only, never on a later run that reuses its task id.
    """
    result.deduplicated = False
    result.deduplication_key = key
    result._dedup_owner = owner
    return result


def owner_of(result: Any) -> str | None:
    """The owner token of the publish ``result`` was returned for, if known."""
    owner = getattr(result, "_dedup_owner", None)
    return owner if isinstance(owner, str) else None
