"""Quick end-to-end check of the Redis store against a real server."""

from celery_dedup.stores import store_from_url


def test_acquire_conflict_release(redis_url: str) -> None:
    """A second owner gets the holder back; only the holder can release."""
    store = store_from_url(redis_url)
    meta = {"task_name": "t", "policy": "success"}
    assert store.acquire("k", "a", 10, meta) is None
    holder = store.acquire("k", "b", 10, meta)
    assert holder is not None and holder.owner == "a" and 0 < holder.ttl <= 10
    assert store.release("k", "b") is False
    assert store.release("k", "a") is True
    assert store.get("k") is None
