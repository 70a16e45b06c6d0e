"""A project in Celery's Django layout whose task modules nothing imports.

Nothing but Celery's autodiscovery imports ``orders.tasks`` (and, with
``LAZY_FAULTS``, ``faults.tasks``): under ``runserver`` they stay
unimported until the project imports its default modules, as a worker does
at start.
"""

from .celery import app as celery_app

__all__ = ["celery_app"]
