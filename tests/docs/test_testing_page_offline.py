"""``docs/testing.md`` runs with no broker, no result backend and no lock store.

The page's app names ``redis://localhost:6379``; here that is a closed
loopback port, so a sample that touched the broker, the result backend or a
Redis store would fail. Every sample and the page's own tests must pass.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_testing_page_needs_no_server(tmp_path: Path) -> None:
    """Every sample of docs/testing.md passes with Redis unreachable."""
    dead = f"redis://127.0.0.1:{_closed_port()}"
    substitutions = {
        "redis://localhost:6379/0": f"{dead}/0",
        "redis://localhost:6379/1": f"{dead}/1",
    }
    # The page's own tests run with only the work directory on the path: make
    # it import this checkout's package, not whichever one is installed.
    (tmp_path / "celery_dedup").symlink_to(ROOT / "celery_dedup")
    done = subprocess.run(
        [sys.executable, "-m", "tests.docs.samples", str(ROOT / "docs" / "testing.md"),
         str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT),
             "DOCS_SUBSTITUTIONS": json.dumps(substitutions)},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout
