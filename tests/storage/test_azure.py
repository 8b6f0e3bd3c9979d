"""Azure backend against its real local server (see conftest.py), through a fault-injecting proxy."""

from __future__ import annotations

from ._contract import ObjectStoreContract


class TestAzure(ObjectStoreContract):
    kind = "az"
