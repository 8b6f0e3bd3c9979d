"""Checkpoint storage: one interface for local/NFS folders and object stores.

``open_storage(uri)`` picks the backend from the URI: a path or ``file://`` →
``LocalStorage``; ``s3://`` → ``S3Storage``; ``gs://`` → ``GCSStorage``;
``az://`` → ``AzureStorage``. Cloud SDKs are optional extras, imported only
when their scheme is used (``registry.py``, not this file, imports a backend);
a missing one is a ``StorageError`` naming the ``pip install`` to run.
"""

from __future__ import annotations

from .base import ObjectInfo, Storage, StorageError, check_key, check_prefix, join_key
from .registry import DEFAULT_URI, ENV_VAR, StorageURIError, check_uri, open_storage, resolve_uri

__all__ = [
    "open_storage",
    "resolve_uri",
    "check_uri",
    "StorageURIError",
    "Storage",
    "StorageError",
    "ObjectInfo",
    "check_key",
    "check_prefix",
    "join_key",
    "DEFAULT_URI",
    "ENV_VAR",
]
