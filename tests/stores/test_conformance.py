"""The lock store contract, run against every store of the table in ``conftest.py``."""

from __future__ import annotations

from tests.stores.contract import StoreContract


class TestStoreContract(StoreContract):
    """Every store of ``STORES`` through the ``store_case`` fixture."""
