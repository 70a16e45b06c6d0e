"""The admin's read-only page of per-key limits, on Redis and PostgreSQL stores.

Slots are taken through the store as a running body takes them; rate
windows are filled by real calls of a task with ``rate_limit_per_key``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings

from celery_dedup import DedupTask, RateLimited
from celery_dedup.identity import digest
from celery_dedup.limits import concurrency_store_key
from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.base import SlotSupport

URL = "/admin/celery_dedup/deduplock/limits/"
LOCKS_URL = "/admin/celery_dedup/deduplock/"
TASK = "tests.django.admin_limits.notify"


def _user(name: str, *, staff: bool, perms: tuple[str, ...]) -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="celery_dedup", codename__in=perms)
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(params=[
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
])
def limited(
    request: pytest.FixtureRequest, celery_app: Any, transactional_db: None
) -> Iterator[Any]:
    """The example app on a Redis or PostgreSQL store, with a task limited per user:
    two of its concurrency keys hold slots, two rate keys have publishes.
    """
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush(9)
        url = server.url(9)
    else:
        url = request.getfixturevalue("store_postgres").url

    @celery_app.task(
        base=DedupTask, name=TASK, shared=False, identity="always_unique",
        concurrency_limit=2, concurrency_key="{user}",
        rate_limit_per_key="2/h", rate_key="{user}", on_duplicate="raise",
    )
    def notify(user: str, n: int) -> int:
        return n

    with override_settings(CELERY_DEDUP_STORE=url):
        reset_runtime(celery_app)
        store = runtime_for(celery_app).store
        assert isinstance(store, SlotSupport)
        prefix = runtime_for(celery_app).settings.key_prefix
        for user, holders in (("ann", 2), ("bob", 1)):
            key = concurrency_store_key(prefix, TASK, user)
            for n in range(holders):
                assert store.take_slot(key, f"{user}-{n}", 2, 60)[0]
        notify.ids = [notify.delay("ann", n).id for n in range(2)]  # type: ignore[attr-defined]
        with pytest.raises(RateLimited):
            notify.delay("ann", 2)
        notify.delay("bob", 0)
        yield notify
    celery_app.tasks.pop(TASK, None)
    reset_runtime(celery_app)
    if request.param == "redis":
        server.flush(9)


def test_limits_page_lists_slots_and_windows(limited: Any) -> None:
    """A viewer sees each key's task, digest, slots in use / limit, and its window."""
    client = _user("viewer", staff=True, perms=("view_deduplock",))
    page = client.get(URL)
    assert page.status_code == 200
    html = page.content.decode()
    slots = html.split('id="dedup-slots"')[1].split("</table>")[0]
    rates = html.split('id="dedup-rates"')[1].split("</table>")[0]
    assert slots.count(TASK + "</a>") == 2
    assert digest("ann")[:16] in slots and digest("bob")[:16] in slots
    assert '<td class="field-in_use">2 / 2</td>' in slots
    assert '<td class="field-in_use">1 / 2</td>' in slots
    assert '<td class="field-count">2 / 2</td>' in rates
    assert '<td class="field-count">1 / 2</td>' in rates
    assert '<td class="field-period">1h 0m</td>' in rates
    assert sum(task_id in rates for task_id in limited.ids) == 1  # ann's newest publish
    assert '<td class="field-free_in">now</td>' in rates  # bob's window has room
    for table in (slots, rates):  # never the key's text
        assert ">ann<" not in table and "'ann'" not in table
    # The locks page links here.
    assert URL in client.get(LOCKS_URL).content.decode()


def test_limits_page_filters_by_task(limited: Any) -> None:
    """``?task=`` shows only that task's keys."""
    client = _user("viewer", staff=True, perms=("view_deduplock",))
    other = client.get(URL, {"task": "shop.tasks.send_digest"}).content.decode()
    assert "No slots in use." in other and "No publishes in any window." in other
    mine = client.get(URL, {"task": TASK}).content.decode()
    assert digest("ann")[:16] in mine


def test_limits_page_needs_the_view_permission(limited: Any) -> None:
    """The list's rules: staff without view/change permission are refused, others
    are sent to log in; change permission is enough to look."""
    assert _user("nobody", staff=True, perms=()).get(URL).status_code == 403
    assert Client().get(URL).status_code == 302
    assert _user("changer", staff=True, perms=("change_deduplock",)).get(URL).status_code == 200


def test_limits_page_on_a_store_without_limits(celery_app: Any, transactional_db: None) -> None:
    """The django-db store keeps no limits: the page answers 200 and says why."""
    reset_runtime(celery_app)
    User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(User.objects.get(username="root"))
    page = client.get(URL)
    assert page.status_code == 200
    assert "Cannot list the per-key limits" in page.content.decode()
