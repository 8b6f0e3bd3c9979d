"""``StorageError``, at the bottom of the storage package: ``base.py`` (the interface) and ``integrity.py``
(checksums, ``DamagedCheckpoint``) both need it, and ``base`` uses ``integrity``'s write log, so it lives
below both of them."""

from __future__ import annotations

__all__ = ["StorageError"]


class StorageError(Exception):
    """A storage URI that cannot be opened, or an operation the store refused."""
