"""Checkpoint storage: one interface for local/NFS folders and object stores.

``open_storage(uri)`` picks the backend from the URI: a path or ``file://`` →
``LocalStorage``; ``s3://`` → ``S3Storage``; ``gs://`` → ``GCSStorage``;
``az://`` → ``AzureStorage``. Cloud SDKs are optional extras, imported only
when their scheme is used; a missing one is a ``StorageError`` naming the
``pip install`` to run.
"""

from __future__ import annotations

import os
import urllib.parse

from .base import ObjectInfo, Storage, StorageError, check_key, check_prefix, join_key

__all__ = [
    "open_storage",
    "resolve_uri",
    "Storage",
    "StorageError",
    "ObjectInfo",
    "check_key",
    "check_prefix",
    "join_key",
    "DEFAULT_URI",
    "ENV_VAR",
]

ENV_VAR = "SPOTGUARD_STORAGE"
DEFAULT_URI = "file://./checkpoints"

_OBJECT_STORES = {"s3": "S3", "gs": "Google Cloud Storage", "az": "Azure Blob Storage"}


def resolve_uri(uri: str | None = None) -> str:
    """The URI to use: the argument, else ``$SPOTGUARD_STORAGE``, else ``file://./checkpoints``."""
    if uri is None or (isinstance(uri, str) and not uri.strip()):
        uri = os.environ.get(ENV_VAR) or DEFAULT_URI
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise StorageError(f"storage must be a URI string or path, got {type(uri).__name__}")
    return uri.strip()


def _local_path_from_uri(uri: str) -> str:
    """``file:///abs``, ``file://./rel``, ``file:rel``, ``file://localhost/abs`` or a plain path."""
    if not uri.startswith("file:"):
        return uri
    rest = uri[len("file:"):]
    if rest.startswith("//"):
        rest = rest[2:]
        # file://HOST/path: only an empty host or localhost mean this machine.
        if not rest.startswith("/") and not rest.startswith("."):
            host, sep, path = rest.partition("/")
            if host in ("localhost", "127.0.0.1"):
                rest = "/" + path
            elif host and not host.startswith("~"):
                raise StorageError(
                    f"file URI {uri!r} names host {host!r}: use file:///absolute/path or a plain path"
                )
    path = urllib.parse.unquote(rest)
    if not path:
        raise StorageError(f"file URI {uri!r} has no path")
    return path


def open_storage(uri: str | None = None) -> Storage:
    """Open the store for ``uri`` (see ``resolve_uri``); relative paths become absolute now.

    Raises ``StorageError`` for unsupported schemes and for backends not available yet.
    """
    uri = resolve_uri(uri)
    scheme, sep, _ = uri.partition("://")
    scheme = scheme.lower() if sep else ""
    if scheme == "s3":
        from .s3 import S3Storage

        return S3Storage(uri)
    if scheme == "gs":
        from .gcs import GCSStorage

        return GCSStorage(uri)
    if scheme == "az":
        from .azure import AzureStorage

        return AzureStorage(uri)
    if sep and scheme != "file":
        raise StorageError(
            f"unsupported storage URI {uri!r}: use file:///path, a plain path, s3://, gs:// or az://"
        )
    from .local import LocalStorage

    return LocalStorage(_local_path_from_uri(uri))
