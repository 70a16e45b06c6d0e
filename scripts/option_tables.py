"""Write the option and setting tables of the docs anew from ``celery_dedup.registry``.

Run after changing the registry: ``python scripts/option_tables.py``; the
docs tests fail while a page's table differs from the registry.
"""

from __future__ import annotations

from pathlib import Path

from celery_dedup.registry import fill_tables

PAGES = ("docs/usage.md", "docs/api.md", "docs/django.md", "docs/limits.md")


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    for page in PAGES:
        path = root / page
        text = path.read_text()
        filled = fill_tables(text)
        if filled != text:
            path.write_text(filled)
            print(f"updated {page}")


if __name__ == "__main__":
    main()
