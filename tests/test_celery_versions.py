"""What celery-dedup relies on holds on every supported Celery (5.3 to 5.7; the nox sessions)."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celery_dedup import DedupTask
from celery_dedup.celery_versions import CELERY_VERSION, at_least


def test_version_is_in_the_supported_range() -> None:
    """The Celery under test is one setup.cfg admits."""
    assert (5, 3) <= CELERY_VERSION < (5, 8)
    assert at_least(5, 3) and not at_least(5, 8)


def test_bound_body_sees_its_own_request_in_eager_mode() -> None:
    """``self.request.id`` in a ``DedupTask`` body is the call's id (Celery < 5.5 lost it)."""
    app = Celery("versions", set_as_current=False)
    app.conf.update(broker_url="memory://", task_always_eager=True,
                    dedup_store="memory://versions")
    seen: list[tuple[Any, Any]] = []
    try:

        @app.task(base=DedupTask, bind=True, shared=False, name="versions.bound")
        def bound(self: Task, n: int) -> int:
            seen.append((self.request.id, self.request.args))
            return n

        result = bound.delay(3)
        assert result.get() == 3
        assert [(task_id, list(args)) for task_id, args in seen] == [(result.id, [3])]
    finally:
        app.close()


def test_pydantic_dump_attribute_exists() -> None:
    """``Task._dump_pydantic_arguments`` (Celery 5.5) is there, ``None`` unless pydantic=True."""
    assert Task._dump_pydantic_arguments is None  # type: ignore[attr-defined]
