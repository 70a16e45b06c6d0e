"""The samples of the docs pages that need Django run here, on the test database.

They run in this process (``tests/docs/samples.py``'s ``run_page``), under
the Django test settings: ``proj/celery.py`` reads them, so the page's app
uses the ``memory://`` broker and the ``django-db`` lock store on SQLite.
Committed transactions (``transactional_db``) fire ``on_commit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery._state import get_current_app

from tests.docs.samples import run_page
from tests.docs.test_samples import DJANGO_PAGES, ROOT


@pytest.fixture
def keep_current_app() -> Iterator[None]:
    """Make the Celery app current before the page current again afterwards."""
    previous = get_current_app()
    yield
    previous.set_current()


@pytest.mark.parametrize("name", sorted(DJANGO_PAGES))
def test_page_samples_run(
    name: str, tmp_path: Path, transactional_db: None, keep_current_app: None
) -> None:
    """The page's Python samples run in order against the Django test database."""
    run_page(ROOT / name, tmp_path)
