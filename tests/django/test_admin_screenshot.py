"""The admin page of live locks in a real browser: headless Chromium renders its lock rows.

The page is served by a WSGI server in a thread of the test (the test's
database, the admin's static files), logged in as a superuser through a
session cookie added to every request, and loaded by Debian's ``chromium``
(``scripts/test`` installs it). With ``DEDUP_DOCS_SCREENSHOT`` set to a path,
the screenshot is also written there (``docs/img/make_screenshot.py`` does
that for ``docs/img/admin-locks.png``).
"""

from __future__ import annotations

import mimetypes
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import django
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.wsgi import get_wsgi_application
from django.test import Client, override_settings

from tests.fixtures._servers import free_port

URL = "/admin/celery_dedup/deduplock/"
ADMIN_STATIC = Path(django.__file__).parent / "contrib" / "admin" / "static"
WIDTH, HEIGHT = 1800, 560


def chromium() -> str:
    """Debian's ``chromium`` (or ``chromium-browser``), which ``scripts/test`` installs."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("chromium is not installed: bash scripts/test installs it")


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on the test's output."""


def _logged_in(app: Any, cookie: str) -> Callable[..., Iterable[bytes]]:
    """Serve the admin's static files; send every other request with the session cookie."""

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/static/"):
            file = (ADMIN_STATIC / path.removeprefix("/static/")).resolve()
            if ADMIN_STATIC in file.parents and file.is_file():
                kind = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
                start_response("200 OK", [("Content-Type", kind)])
                return [file.read_bytes()]
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        environ["HTTP_COOKIE"] = f"{settings.SESSION_COOKIE_NAME}={cookie}"
        result: Iterable[bytes] = app(environ, start_response)
        return result

    return wsgi


@pytest.fixture
def admin_url(transactional_db: None, celery_app: Any) -> Iterator[str]:
    """The lock page's URL on a live server, logged in as a superuser."""
    with override_settings(STATIC_URL="/static/", ALLOWED_HOSTS=["127.0.0.1"]):
        user = User.objects.create_superuser("admin", "admin@example.com", "pw")
        client = Client()
        client.force_login(user)
        cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
        server: WSGIServer = make_server(
            "127.0.0.1", free_port(), _logged_in(get_wsgi_application(), cookie),
            handler_class=_Quiet,
        )
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}{URL}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


def _chromium(*args: str) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--no-first-run",
             f"--user-data-dir={profile}", "--hide-scrollbars", *args],
            capture_output=True, timeout=120, check=True,
        )


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_chromium_renders_the_lock_rows(admin_url: str, celery_app: Any, tmp_path: Path) -> None:
    """Chromium shows a row per lock with its holder, state and need; the screenshot is real."""
    from shop.tasks import process_payment, send_digest, sync_address

    digest = send_digest.delay(7)
    sync = sync_address.delay(42, {"zip": "10115"})
    payment = process_payment.delay("pay-1", "9.99", "EUR")
    celery_app.backend.store_result(digest.id, "digest sent", "SUCCESS")
    celery_app.backend.store_result(payment.id, {"pid": 1}, "STARTED")

    dom = _chromium("--dump-dom", admin_url).stdout.decode()
    assert "Live deduplication locks" in dom and 'id="result_list"' in dom
    rows = [row for row in dom.split("<tr>") if 'class="field-task_name"' in row]
    assert len(rows) == 3
    for result, state in ((digest, "finished (SUCCESS)"), (sync, "not started (PENDING)"),
                          (payment, "running (STARTED)")):
        row = next(r for r in rows if result.id in r)
        assert f'<td class="field-state">{state}</td>' in row
    assert "3 live locks in the django-db store" in dom

    shot = tmp_path / "admin-locks.png"
    _chromium(f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", admin_url)
    data = shot.read_bytes()
    assert _png_size(data) == (WIDTH, HEIGHT)
    assert len(data) > 20_000  # a rendered page, not a blank one
    target = os.environ.get("DEDUP_DOCS_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)
