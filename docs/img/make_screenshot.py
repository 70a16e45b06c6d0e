"""Re-create the docs' screenshots from real runs.

* ``docs/img/flower-task.png``: Flower's page of a holder and its duplicates.
  Starts a throwaway redis-server and a real Flower on free loopback ports,
  an in-process worker with events on, publishes one holder plus three
  duplicates, then asks headless Chromium for a screenshot of the holder's
  task page.
* ``docs/img/admin-locks.png``: the Django admin page of live locks, taken
  by ``tests/django/test_admin_screenshot.py`` (three locks in three holder
  states, served to headless Chromium), which writes it when
  ``DEDUP_DOCS_SCREENSHOT`` names the file.

Run from the repository root::

    python docs/img/make_screenshot.py

Needs ``redis-server``, ``flower`` and ``chromium`` (or ``chromium-browser``).
The docs site does not publish this script (``exclude_docs`` in mkdocs.yml).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from celery.app import trace  # noqa: E402
from celery.contrib.testing.worker import start_worker  # noqa: E402

from celery_dedup.runtime import runtime_for  # noqa: E402
from tests.apps.cli_app import SLOW, make_app  # noqa: E402
from tests.fixtures._servers import free_port, running  # noqa: E402
from tests.fixtures.flower import (  # noqa: E402
    FlowerServer,
    flower_argv,
    flower_env,
    wait_until_listening,
)
from tests.fixtures.redis import start_redis  # noqa: E402

OUT = Path(__file__).resolve().parent / "flower-task.png"
ADMIN_OUT = Path(__file__).resolve().parent / "admin-locks.png"
WORKER = "worker1@example"
#: tall enough to show the holder's "Children" row below its details
HEIGHT = 1400


def chromium() -> str:
    """The installed Chromium binary."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("install chromium to take the screenshot")


def screenshot(url: str, out: Path) -> None:
    """A 1280-wide headless screenshot of ``url``."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                f"--screenshot={out}", f"--window-size=1280,{HEIGHT}", "--hide-scrollbars", url,
            ],
            check=True, capture_output=True, timeout=120,
        )


def admin_screenshot() -> None:
    """Run the admin screenshot test, which writes ``ADMIN_OUT``."""
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "django", "--ds=tests.django.settings",
         "tests/django/test_admin_screenshot.py"],
        cwd=ROOT, env={**os.environ, "DEDUP_DOCS_SCREENSHOT": str(ADMIN_OUT)}, check=True,
    )
    print(f"wrote {ADMIN_OUT.relative_to(ROOT)}")


def main() -> None:
    """Start everything, publish a holder and its duplicates, take the screenshots."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        redis_argv, redis_port = start_redis(directory)
        with running(redis_argv, redis_port, log=directory / "redis.log"):
            broker = f"redis://127.0.0.1:{redis_port}/0"
            port = free_port()
            flower = FlowerServer(port=port, broker_url=broker, log=directory / "flower.log")
            with running(flower_argv(broker, port), port, log=flower.log, env=flower_env()):
                wait_until_listening(flower)
                app = make_app(
                    broker, f"redis://127.0.0.1:{redis_port}/1",
                    worker_send_task_events=True, task_send_sent_event=True,
                )
                trace.setup_worker_optimizations(app, WORKER)
                with start_worker(app, pool="threads", concurrency=2, hostname=WORKER,
                                  perform_ping_check=False, loglevel="WARNING"):
                    slow = app.tasks[SLOW]
                    holder = slow.delay(1.0, tag="report-42")
                    duplicates = [slow.delay(1.0, tag="report-42") for _ in range(3)]
                    holder.get(timeout=30)
                    wanted = {d.duplicate_id for d in duplicates}
                    flower.wait_for(
                        lambda: (info := flower.task(holder.id))
                        and info["state"] == "SUCCESS"
                        and set(info["children"]) >= wanted
                    )
                    screenshot(f"{flower.url}/task/{holder.id}", OUT)
                trace.reset_worker_optimizations(app)
                runtime_for(app).metrics.flush()
    print(f"wrote {OUT.relative_to(ROOT)}")
    admin_screenshot()


if __name__ == "__main__":
    main()
