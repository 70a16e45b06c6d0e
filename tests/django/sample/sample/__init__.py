"""A project as a team would have it: its own tests, two Celery apps, PostgreSQL or MariaDB."""
