"""Errors and knobs every object-store module shares (``objstore.py``, ``objupload.py``, the backends).

Kept below the rest so that the upload streams and the base storage can both raise the same errors
without importing each other.
"""

from __future__ import annotations

import os
import urllib.parse

from .base import StorageError, check_prefix

__all__ = ["ObjectStoreError", "DeadlineExceeded", "env_int", "split_bucket_uri", "missing_extra", "MiB",
           "DEFAULT_PART_SIZE", "MAX_PART_SIZE", "MAX_CONCURRENCY", "DEFAULT_CONCURRENCY",
           "DEFAULT_ZERO_COPY_PART_SIZE"]

MiB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MiB
# Bounds on the env knobs, so a typo (SPOTGUARD_PART_SIZE=1e18) cannot allocate the machine away:
# 5 GiB is S3's largest part; more parallel parts than this only adds memory.
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_CONCURRENCY = 256
DEFAULT_CONCURRENCY = 8
DEFAULT_ZERO_COPY_PART_SIZE = 64 * MiB


class ObjectStoreError(StorageError, OSError):
    """A request the store refused or that kept failing. Also an OSError, so callers that
    tolerate I/O errors (e.g. the best-effort ``latest`` hint) tolerate these too."""


class DeadlineExceeded(ObjectStoreError, TimeoutError):
    """The notice deadline passed (or a retry could not finish before it)."""


def env_int(name: str, default: int) -> int:
    """An integer from the environment (accepts ``16MiB``-style suffixes), else ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    mult = 1
    for suffix, m in (("KiB", 1024), ("MiB", MiB), ("GiB", 1024 * MiB), ("K", 1024), ("M", MiB), ("G", 1024 * MiB)):
        if raw.endswith(suffix):
            raw, mult = raw[: -len(suffix)], m
            break
    try:
        return int(float(raw) * mult)
    except (ValueError, OverflowError):  # "abc", "nan" / "1e400", "inf"
        raise StorageError(f"${name}={os.environ[name]!r} is not a finite number") from None


def split_bucket_uri(uri: str, scheme: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ("bucket", "a/b/"); the prefix is '' or ends with '/'."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme.lower() != scheme or not parsed.netloc:
        raise StorageError(f"storage URI {uri!r} must look like {scheme}://BUCKET[/prefix]")
    if parsed.query or parsed.fragment:
        raise StorageError(f"storage URI {uri!r} may not carry a query or fragment")
    prefix = urllib.parse.unquote(parsed.path).strip("/")
    if prefix:
        check_prefix(prefix + "/")
    return parsed.netloc, (prefix + "/" if prefix else "")


def missing_extra(what: str, extra: str, exc: BaseException) -> StorageError:
    """The error for a backend whose optional SDK is not installed."""
    return StorageError(f"{what} needs the optional dependencies of spotguard[{extra}] "
                        f"({exc}): pip install 'spotguard[{extra}]'")
