"""An app whose tasks only Celery's autodiscovery imports."""
