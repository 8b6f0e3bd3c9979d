"""The object-store fixtures of ``tests/storage/conftest.py`` (moto, Azurite, gcp-storage-emulator), for hook tests.

``tests/`` is not a package (pytest runs with ``--import-mode=importlib``), so
``tests/storage`` is loaded once under a private package name and its fixtures
are re-exported: ``from ._stores import Store, servers, store``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

_NAME = "_spotguard_storage_tests"


def _load():  # -> module
    if _NAME not in sys.modules:
        pkg = Path(__file__).resolve().parents[1] / "storage"
        spec = importlib.util.spec_from_file_location(_NAME, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(_NAME + ".conftest")


_conftest = _load()
Store = _conftest.Store
servers = _conftest.servers
store = _conftest.store

__all__ = ["Store", "servers", "store"]
