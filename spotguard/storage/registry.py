"""Which backend serves which storage URI, and opening it (``open_storage``).

Why a registry: the backends import the object-store base and the DCP readers/writers, and the cloud SDKs
are optional extras; naming each backend here as (module, class) and importing it only when its scheme is
opened keeps ``spotguard.storage`` (the package the hook, the CLI and the adapters import) free of them,
and keeps the package's ``__init__`` from importing anything above ``base.py``.
"""

from __future__ import annotations

import importlib
import os
import re
import urllib.parse

from .base import Storage, StorageError

__all__ = ["open_storage", "resolve_uri", "check_uri", "StorageURIError", "BACKENDS", "backend", "DEFAULT_URI",
           "ENV_VAR"]

#: scheme -> (module, class); imported on first use, so a missing SDK only matters to its own scheme
BACKENDS: dict[str, tuple[str, str]] = {
    "s3": ("spotguard.storage.s3", "S3Storage"),
    "gs": ("spotguard.storage.gcs", "GCSStorage"),
    "az": ("spotguard.storage.azure", "AzureStorage"),
    "file": ("spotguard.storage.local", "LocalStorage"),
}


def backend(scheme: str) -> type[Storage]:
    """The ``Storage`` class for ``scheme`` (a key of ``BACKENDS``), imported now."""
    module, name = BACKENDS[scheme]
    cls: type[Storage] = getattr(importlib.import_module(module), name)
    return cls


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


class StorageURIError(StorageError, ValueError):
    """A storage URI that is almost, but not exactly, a known form (``s3:/b``, ``gcs://b``, ``s3//b``)."""


_KNOWN_FORMS = "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///abs/path or a plain path"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(.*)$", re.S)
_NEAR = {"s3": "s3", "s3a": "s3", "s3n": "s3", "aws": "s3", "gs": "gs", "gcs": "gs", "gcp": "gs", "google": "gs",
         "az": "az", "azure": "az", "abfs": "az", "abfss": "az", "wasb": "az", "wasbs": "az", "blob": "az",
         "file": "file"}
_SLASHLESS = re.compile(r"^(s3|gs|az|file)//", re.I)


def check_uri(uri: str) -> str:
    """Refuse scheme-like prefixes that are not exactly a known form; returns ``uri`` unchanged.

    Why: ``s3:/bucket/run`` or ``s3//bucket/run`` used to be taken as relative
    folders, so checkpoints went to the VM's own disk, which disappears with it.
    A plain path that starts with something like ``name:`` can be written ``./name:...``.
    """
    m = _SCHEME.match(uri)
    if m is None:
        bad = _SLASHLESS.match(uri)
        if bad:
            scheme = bad.group(1).lower()
            fix = f"{scheme}:{uri[len(scheme):]}"
            raise StorageURIError(f"storage URI {uri!r} looks like a {scheme}:// URI without its ':': "
                                  f"did you mean {fix!r}? (a local folder named {scheme!r} is written "
                                  f"./{uri}); known forms: {_KNOWN_FORMS}")
        return uri
    scheme, rest = m.group(1).lower(), m.group(2)
    near = _NEAR.get(scheme)
    if near in ("s3", "gs", "az") and scheme == near:
        if rest.startswith("//") and len(rest) > 2 and rest[2] != "/":
            return uri
        fix = f"{near}://{rest.lstrip('/')}"
        raise StorageURIError(f"storage URI {uri!r} is malformed: did you mean {fix!r}? known forms: {_KNOWN_FORMS}")
    if scheme == "file":
        if rest.startswith("/"):
            return uri
        raise StorageURIError(f"storage URI {uri!r} is malformed: did you mean 'file://./{rest}' (relative) or "
                              f"'file:///{rest}' (absolute)? known forms: {_KNOWN_FORMS}")
    if near is not None:
        fix = f"{near}://{rest.lstrip('/')}"
        raise StorageURIError(f"unsupported storage scheme {scheme + ':'!r} in {uri!r}: did you mean {fix!r}? "
                              f"known forms: {_KNOWN_FORMS}")
    if scheme in ("http", "https"):
        raise StorageURIError(f"storage URI {uri!r} is an HTTP endpoint: name the bucket (s3://bucket/prefix) "
                              "and set the endpoint with AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST or "
                              "AZURE_STORAGE_CONNECTION_STRING")
    raise StorageURIError(f"unsupported storage URI {uri!r}: known forms: {_KNOWN_FORMS} "
                          f"(a local path that starts with {scheme + ':'!r} is written ./{uri})")


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

    Raises ``StorageURIError`` (a ``StorageError`` and a ``ValueError``) for a malformed or
    unknown scheme, ``StorageError`` for backends whose SDK is not installed.
    """
    uri = check_uri(resolve_uri(uri))
    scheme, sep, _ = uri.partition("://")
    scheme = scheme.lower() if sep else ""
    if scheme in BACKENDS and scheme != "file":
        return backend(scheme)(uri)
    if sep and scheme != "file":
        raise StorageError(
            f"unsupported storage URI {uri!r}: use file:///path, a plain path, s3://, gs:// or az://"
        )
    return backend("file")(_local_path_from_uri(uri))
