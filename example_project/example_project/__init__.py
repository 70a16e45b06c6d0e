"""The example project; importing it loads the Celery app (Celery's Django layout)."""

from .celery import app as celery_app

__all__ = ("celery_app",)
