"""A project as a team would have it: its own tests, two Celery apps, PostgreSQL or MariaDB."""

from .celery import app as celery_app

__all__ = ["celery_app"]
