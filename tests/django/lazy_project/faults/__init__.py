"""An app whose tasks ``dedup_locks check`` fails on."""
