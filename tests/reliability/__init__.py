"""A reliability suite that tries to break celery-dedup's guarantees on real processes."""
