"""The admin lock list fits a 1280 px wide window: every column on screen, no sideways scroll."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.wsgi import get_wsgi_application
from django.test import Client, override_settings

from celery_dedup.runtime import runtime_for
from tests.django.test_admin_screenshot import URL, _chromium, _logged_in, _Quiet
from tests.fixtures._servers import free_port

#: run once the page and its images are loaded; --dump-dom carries the numbers out
MEASURE = b"""<script>
window.addEventListener("load", () => {
  const cells = [...document.querySelectorAll("#result_list th, #result_list td")];
  const right = Math.max(...cells.map((c) => c.getBoundingClientRect().right));
  document.body.dataset.tableRight = Math.ceil(right);
  document.body.dataset.viewport = document.documentElement.clientWidth;
  document.body.dataset.scrollWidth = document.documentElement.scrollWidth;
  // The results box clips what does not fit beside the filter: compare with its edge.
  const box = document.querySelector("#changelist .changelist-form-container");
  document.body.dataset.hidden = Math.ceil(right - box.getBoundingClientRect().right);
});
</script></body>"""


def _measured(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def without_length(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            kept = [(k, v) for k, v in headers if k.lower() != "content-length"]
            return start_response(status, kept, *exc)

        body = b"".join(app(environ, without_length))
        return [body.replace(b"</body>", MEASURE)]

    return wsgi


@pytest.fixture
def measured_url(transactional_db: None, celery_app: Any) -> Iterator[str]:
    """The lock page on a live server, logged in, with the measuring script added."""
    with override_settings(STATIC_URL="/static/", ALLOWED_HOSTS=["127.0.0.1"]):
        user = User.objects.create_superuser("admin", "admin@example.com", "pw")
        client = Client()
        client.force_login(user)
        cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
        app = _measured(_logged_in(get_wsgi_application(), cookie))
        server: WSGIServer = make_server("127.0.0.1", free_port(), app, handler_class=_Quiet)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}{URL}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


def test_lock_list_fits_1280_px(measured_url: str, celery_app: Any) -> None:
    """At 1280 px every column (holder state, policy, expiry, still needed) is on screen."""
    from shop.tasks import process_payment, send_digest, sync_address

    send_digest.delay(7)
    sync_address.delay(42, {"street": "Invalidenstr. 1", "zip": "10115"})
    payment = process_payment.delay("pay-1", "9.99", "EUR")
    celery_app.backend.store_result(payment.id, {"pid": 1}, "STARTED")
    # A third-party project's long dotted task name has no natural break point.
    long_name = "thirdparty.notifications.tasks.send_weekly_digest_email_to_all_subscribers"
    store = runtime_for(celery_app).store
    key = f"celery-dedup:{long_name}:{'ab' * 16}"
    meta = {"task_name": long_name, "policy": "success", "task_id": str(uuid.uuid4())}
    assert store.acquire(key, "owner-1", 600, meta) is None

    dom = _chromium("--window-size=1280,800", "--dump-dom", measured_url).stdout.decode()
    found = dict(re.findall(r'data-(table-right|viewport|scroll-width|hidden)="(-?\d+)"', dom))
    assert set(found) == {"table-right", "viewport", "scroll-width", "hidden"}, dom[-2000:]
    viewport = int(found["viewport"])
    assert 1200 <= viewport <= 1280
    assert int(found["table-right"]) <= viewport, found
    assert int(found["scroll-width"]) <= viewport, found
    assert int(found["hidden"]) <= 0, found  # nothing scrolled away inside the results box
    assert "Still needed" in dom and "running (STARTED)" in dom and long_name in dom
