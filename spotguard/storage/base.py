"""The storage seam: one small interface for local/NFS paths and (later) object stores.

Why this shape: the commit protocol (``commit.py``) needs only whole-object
writes that become visible atomically, listing with sizes, and prefix deletes —
operations every object store offers natively. The heavy path (checkpoint
shards) goes through ``torch.distributed.checkpoint`` writer/reader objects
that each backend supplies, so an object store can stream parallel multipart
uploads from memory and ranged reads without the commit logic knowing.
"""

from __future__ import annotations

import abc
import contextlib
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from .errors import StorageError

if TYPE_CHECKING:  # torch is imported lazily: the daemon and the CLI never need it
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    from .integrity import FileDigest, WriteLog

__all__ = ["StorageError", "ObjectInfo", "Storage", "check_key", "check_prefix", "join_key"]


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key relative to the storage root, size in bytes, mtime (epoch s)."""

    key: str
    size: int
    mtime: float


def _check_parts(text: str, what: str, allow_trailing_slash: bool) -> str:
    if not isinstance(text, str):
        raise StorageError(f"{what} must be a string, got {type(text).__name__}")
    if "\x00" in text or "\\" in text:
        raise StorageError(f"{what} {text!r} contains a NUL or backslash")
    if text.startswith("/"):
        raise StorageError(f"{what} {text!r} is absolute: keys are relative to the storage root")
    body = text[:-1] if (allow_trailing_slash and text.endswith("/")) else text
    if not body:
        return text
    for part in body.split("/"):
        if part in ("", ".", ".."):
            raise StorageError(
                f"{what} {text!r} has an empty, '.' or '..' component: keys may not escape the storage root"
            )
    return text


def check_key(key: str) -> str:
    """Validate an object key ('/'-separated, relative, no '..'); returns it unchanged."""
    _check_parts(key, "key", allow_trailing_slash=False)
    if not key:
        raise StorageError("key must not be empty")
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing/deletion prefix: like a key, but may be empty or end with '/'."""
    return _check_parts(prefix, "prefix", allow_trailing_slash=True)


def join_key(*parts: str) -> str:
    """Join key parts with '/', ignoring empty ones (``join_key("step-00000001", "COMMIT.json")``)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Storage(abc.ABC):
    """A checkpoint store rooted at ``uri``. Keys are '/'-separated and relative to the root.

    Prefix semantics follow object stores: ``list("step-00000001/")`` is every key
    that starts with that string. Use a trailing '/' to mean "this folder".
    """

    uri: str

    @abc.abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``: visible atomically (all or nothing) and durable on return."""

    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` if absent."""

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``key`` (fewer if the object is shorter); ``FileNotFoundError`` if absent."""
        return self.read_bytes(key)[start:end]

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under exactly ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive), sorted by key."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose key starts with ``prefix`` (missing ones are fine)."""

    @abc.abstractmethod
    def dcp_writer(self, key: str, *, thread_count: int | None = None) -> "StorageWriter":
        """A ``torch.distributed.checkpoint`` writer that stores a checkpoint under folder ``key``.

        Every byte it writes is durable when ``dcp.save`` returns on each rank.
        ``thread_count``: parallel writers per rank (None: the backend's default).
        """

    @abc.abstractmethod
    def dcp_reader(self, key: str, digests: "Mapping[str, FileDigest] | None" = None) -> "StorageReader":
        """A ``torch.distributed.checkpoint`` reader for the checkpoint under folder ``key``.

        ``digests`` (the commit record's checksums): every byte is verified against
        them before it is used, and a mismatch raises ``DamagedCheckpoint``.
        ``.metadata`` is read with a restricted unpickler either way.
        """

    @contextlib.contextmanager
    def deadline_at(self, deadline: float | None) -> Iterator[None]:
        """Bound every request made inside the block by ``deadline`` (a ``time.monotonic()`` value).

        Object stores stop retrying and fail with ``DeadlineExceeded`` instead of
        running past the notice; local folders have nothing to bound (no-op).
        """
        yield

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort unfinished multipart/block uploads under ``prefix`` (a killed save's orphans); returns how many.

        Local folders have none; object stores override this.
        """
        return 0

    @property
    def write_log(self) -> "WriteLog":
        """What this process wrote under each checkpoint folder (name, size, checksum), for the commit record."""
        log = self.__dict__.get("_write_log")
        if log is None:
            from .integrity import WriteLog

            log = self.__dict__.setdefault("_write_log", WriteLog())
        return log

    def local_path(self, key: str) -> pathlib.Path | None:
        """The filesystem path of ``key`` when the store is a local/NFS folder, else None."""
        return None

    def make_durable(self, key: str) -> None:
        """Make everything under folder ``key`` durable (local: fsync files and dirs). No-op for object stores."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def describe(self) -> dict[str, Any]:
        """A small dict for logs."""
        return {"uri": self.uri, "backend": type(self).__name__}
