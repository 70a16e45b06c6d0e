"""The admin page of live locks, with locks taken and left by a real worker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from celery_dedup.runtime import runtime_for

URL = "/admin/celery_dedup/deduplock/"


def started(app: Any, result: Any) -> None:
    """Mark ``result``'s lock started, as the worker's claim does (the run then died)."""
    store = runtime_for(app).store
    assert store is not None
    lock = store.get(result.deduplication_key)
    assert lock is not None
    store.claim(lock.key, lock.owner, release=False, ttl=None, meta={})


def _user(name: str, *, staff: bool, perms: tuple[str, ...]) -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="celery_dedup", codename__in=perms)
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def held(worker: Any, celery_app: Any) -> Any:
    """A ``send_digest`` run by the worker: its ``expiry`` lock stays held with a stored result."""
    from shop.tasks import send_digest

    result = send_digest.delay(7)
    assert result.get(timeout=30) == "digest sent to user 7"
    return result


@pytest.fixture
def pending(celery_app: Any, transactional_db: None) -> Any:
    """A published ``send_digest`` nobody runs (no worker here): its lock is held."""
    from shop.tasks import send_digest

    return send_digest.delay(8)


def test_changelist_lists_real_locks(held: Any) -> None:
    """A staff user with view permission sees task, digest, holder (linked), state and policy."""
    client = _user("viewer", staff=True, perms=("view_deduplock",))
    page = client.get(URL)
    assert page.status_code == 200
    html = page.content.decode()
    assert "shop.tasks.send_digest" in html
    assert held.deduplication_key.rsplit(":", 1)[-1][:16] in html
    assert held.id in html and "expiry" in html
    assert "/admin/django_celery_results/taskresult/" in html  # the holder's result
    assert '<td class="field-state">finished (SUCCESS)</td>' in html
    assert "Holder state</span>" in html and "Still needed</span>" in html
    assert "Release selected locks" not in html  # no delete permission, no action


def test_search_filter_count_and_call_lookup(pending: Any, celery_app: Any) -> None:
    """Search, the task filter and the call lookup narrow the list, and the count follows."""
    from shop.tasks import sync_address

    sync = sync_address.delay(1, {"zip": "10115"})  # a second lock, pending (never run here)
    client = _user("viewer", staff=True, perms=("view_deduplock",))
    both = client.get(URL).content.decode()
    assert "shop.tasks.send_digest" in both and "shop.tasks.sync_address" in both
    assert "2 live locks in the django-db store" in both
    filtered = client.get(URL, {"task": "shop.tasks.sync_address"}).content.decode()
    assert pending.id not in filtered and sync.id in filtered
    searched = client.get(URL, {"q": pending.id}).content.decode()
    assert pending.id in searched and sync.id not in searched
    assert "1 matching lock of 2 live" in searched
    found = client.get(URL, {
        "lookup_task": "shop.tasks.sync_address", "lookup_args": '[1, {"zip": "10115"}]',
    }).content.decode()
    assert sync.id in found and pending.id not in found
    assert f"key digest is {sync.deduplication_key.rsplit(':', 1)[-1][:16]}" in found
    other = client.get(URL, {
        "lookup_task": "shop.tasks.sync_address", "lookup_kwargs": '{"user_id": 2, "address": {}}',
    }).content.decode()
    assert "No live lock: the call would be published." in other
    bad = client.get(URL, {"lookup_task": "shop.tasks.sync_address", "lookup_args": "[1"})
    assert 'class="errornote"' in bad.content.decode()


def _post(client: Client, *values: str, **extra: str) -> Any:
    data = {"action": "release_selected", "_selected_action": list(values), **extra}
    return client.post(URL, data, follow=True)


def test_release_shows_a_confirmation_with_the_holder_state(held: Any, celery_app: Any) -> None:
    """The action first shows each lock's holder state and why it is needed; nothing is freed."""
    client = _user("releaser", staff=True, perms=("view_deduplock", "delete_deduplock"))
    assert "Release selected locks" in client.get(URL).content.decode()
    value = json.dumps([held.deduplication_key, held.id])
    page = _post(client, value).content.decode()
    assert "Release this lock?" in page
    assert "finished (SUCCESS)" in page
    assert "unique_until=&#x27;expiry&#x27; keeps the lock" in page
    assert 'name="force"' in page and 'name="post" value="yes"' in page
    assert runtime_for(celery_app).store.get(held.deduplication_key) is not None


def test_confirmed_release_keeps_needed_locks_unless_forced(held: Any, celery_app: Any) -> None:
    """Confirming without the box keeps the throttle; with it the lock goes and the call runs."""
    from shop.tasks import send_digest

    client = _user("releaser", staff=True, perms=("view_deduplock", "delete_deduplock"))
    value = json.dumps([held.deduplication_key, held.id])
    kept = _post(client, value, post="yes").content.decode()
    assert "Released 0 locks." in kept and "Kept " in kept
    assert runtime_for(celery_app).store.get(held.deduplication_key) is not None
    assert send_digest.delay(7).deduplicated is True
    forced = _post(client, value, post="yes", force="yes").content.decode()
    assert "Released 1 lock." in forced
    assert runtime_for(celery_app).store.get(held.deduplication_key) is None
    again = send_digest.delay(7)
    assert again.deduplicated is False and again.get(timeout=30)


def test_confirmed_release_of_a_lock_nobody_needs(pending: Any, celery_app: Any) -> None:
    """A lock whose holder's result says it finished (its release was lost) goes without force."""
    from shop.tasks import sync_address

    lost = sync_address.delay(3, {"zip": "3"})
    started(celery_app, lost)
    celery_app.backend.store_result(lost.id, "synced", "SUCCESS")
    client = _user("releaser", staff=True, perms=("view_deduplock", "delete_deduplock"))
    page = _post(client, json.dumps([lost.deduplication_key, lost.id])).content.decode()
    assert 'name="force"' not in page  # nothing needed: no box to tick
    done = _post(client, json.dumps([lost.deduplication_key, lost.id]), post="yes")
    assert "Released 1 lock." in done.content.decode()
    assert runtime_for(celery_app).store.get(lost.deduplication_key) is None


def test_release_action_is_owner_checked(pending: Any, celery_app: Any) -> None:
    """A selection naming a holder that no longer holds the lock releases nothing."""
    client = _user("releaser", staff=True, perms=("view_deduplock", "delete_deduplock"))
    stale = json.dumps([pending.deduplication_key, "some-earlier-holder"])
    page = _post(client, stale).content.decode()
    assert "None of the selected locks is still held." in page
    response = _post(client, stale, post="yes", force="yes")
    assert "1 lock was not released" in response.content.decode()
    lock = runtime_for(celery_app).store.get(pending.deduplication_key)
    assert lock is not None and lock.task_id == pending.id


def test_release_needs_delete_permission(pending: Any, celery_app: Any) -> None:
    """Posting the action without the delete permission is refused and keeps the lock."""
    client = _user("viewer", staff=True, perms=("view_deduplock",))
    value = json.dumps([pending.deduplication_key, pending.id])
    response = client.post(URL, {"action": "release_selected", "_selected_action": [value]})
    assert response.status_code == 403
    assert runtime_for(celery_app).store.get(pending.deduplication_key) is not None


def test_non_staff_user_is_refused(pending: Any) -> None:
    """A logged-in user who is not staff is sent to the admin login, even with permissions."""
    client = _user("customer", staff=False, perms=("view_deduplock", "delete_deduplock"))
    response = client.get(URL)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert pending.id not in client.get(URL, follow=True).content.decode()


def test_anonymous_user_is_refused(pending: Any, celery_app: Any) -> None:
    """Not logged in: sent to the login page; posting the release action frees nothing."""
    client = Client()
    response = client.get(URL)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    value = json.dumps([pending.deduplication_key, pending.id])
    posted = client.post(URL, {"action": "release_selected", "_selected_action": [value]})
    assert posted.status_code == 302 and "/admin/login/" in posted["Location"]
    assert runtime_for(celery_app).store.get(pending.deduplication_key) is not None


def test_staff_without_model_permission_is_refused(pending: Any) -> None:
    """Staff without the lock model's view permission get 403."""
    client = _user("staff", staff=True, perms=())
    assert client.get(URL).status_code == 403


def test_admin_lists_a_redis_store(celery_app: Any, redis_url: str, transactional_db: None) -> None:
    """With another store (Redis) the same page lists and releases its locks."""
    from django.test import override_settings
    from shop.tasks import sync_address

    from celery_dedup.runtime import reset_runtime

    with override_settings(CELERY_DEDUP_STORE=redis_url):
        reset_runtime(celery_app)
        sync_address._dedup_config = None
        result = sync_address.delay(5, {"zip": "1"})
        store = runtime_for(celery_app).store
        assert type(store).__name__ == "RedisStore"
        client = _user("releaser", staff=True, perms=("view_deduplock", "delete_deduplock"))
        assert result.id in client.get(URL).content.decode()
        value = json.dumps([result.deduplication_key, result.id])
        assert "not started (PENDING)" in _post(client, value).content.decode()
        _post(client, value, post="yes", force="yes")
        assert store.get(result.deduplication_key) is None
    sync_address._dedup_config = None
