"""Celery apps the tests import in-process or run through the ``celery`` command."""
