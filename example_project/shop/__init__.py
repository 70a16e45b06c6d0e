"""The example shop: tasks that mirror real uses of celery-dedup."""
