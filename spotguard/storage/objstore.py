"""What every object-store backend shares: the ``Storage`` API on full object names, deadline-bounded retries,
the I/O executor and the part-buffer pool. Streams are in ``objupload.py``, part memory in ``objmemory.py``,
errors and knobs in ``objcommon.py`` (all re-exported here: the backends and tests import them from here).

Why one base class: S3 multipart, Azure block blobs and GCS resumable uploads are
the same shape — "start, send numbered parts, finish or abort" — so the part
streaming, the memory bound, the retry/deadline rules and the DCP writer/reader
(``dcp_object.py``) are written once. A backend supplies a handful of
primitives on *full object names* (root prefix included) and says which
exceptions are worth retrying.

Deadline rule: ``storage.deadline`` (a ``time.monotonic()`` value, or None) bounds
every request and every backoff sleep. A retry that could not finish before it
raises ``DeadlineExceeded`` at once instead of sleeping past the notice: the
save fails clearly, nothing is committed, and the previous commit is untouched.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from ..logs import get_logger
from .base import ObjectInfo, Storage, StorageError, check_key, check_prefix
from .integrity import FileDigest, crc32c_of_blocks, digest_of
from .objcommon import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    DEFAULT_ZERO_COPY_PART_SIZE,
    MAX_CONCURRENCY,
    MAX_PART_SIZE,
    DeadlineExceeded,
    MiB,
    ObjectStoreError,
    env_int,
    missing_extra,
    split_bucket_uri,
)
from .objmemory import (
    BufferPool,
    MemReader,
    SegmentReader,
    Segments,
    _b64,
    body_of,
    part_crc32c,
    part_md5,
    request_body,
)
from .objupload import StagedSource, Upload, UploadStream, ZeroCopySource

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

__all__ = [
    "ObjectStoreError",
    "DeadlineExceeded",
    "ObjectStorage",
    "RawObject",
    "Upload",
    "UploadStream",
    "BufferPool",
    "MemReader",
    "Segments",
    "SegmentReader",
    "StagedSource",
    "ZeroCopySource",
    "env_int",
    "split_bucket_uri",
    "missing_extra",
    "request_body",
    "body_of",
    "part_md5",
    "part_crc32c",
    "MiB",
    "DEFAULT_PART_SIZE",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_ZERO_COPY_PART_SIZE",
    "MAX_PART_SIZE",
    "MAX_CONCURRENCY",
]

T = TypeVar("T")
log = get_logger("spotguard.storage")

# Retry jitter from a private generator: a periodic upload retries in a background thread while
# the job trains, and drawing from the global `random` would change the training's random stream
# (found by the chaos run: the resumed job then diverges from an uninterrupted one).
_JITTER = random.Random()


@dataclass(frozen=True)
class RawObject:
    name: str  # full object name, root prefix included
    size: int
    mtime: float


class ObjectStorage(Storage):
    """A ``Storage`` on an object store. Subclasses implement the ``_``-primitives on full names."""

    scheme: str = ""
    #: keys under this (relative) prefix are the backend's own bookkeeping, never listed
    hidden_prefix: str | None = None
    min_part_size: int = 256 * 1024
    part_alignment: int = 1
    #: the backend's ``Upload.part`` / ``_put`` accept ``Segments`` and send them without joining
    zero_copy: bool = False

    def __init__(self, uri: str, *, part_size: int | None = None, concurrency: int | None = None,
                 max_attempts: int | None = None, backoff: float = 0.2, backoff_cap: float = 5.0,
                 request_timeout: float = 60.0) -> None:
        self.bucket, self.root = split_bucket_uri(uri, self.scheme)
        self.uri = f"{self.scheme}://{self.bucket}" + (f"/{self.root.rstrip('/')}" if self.root else "")
        part = part_size or env_int("SPOTGUARD_PART_SIZE", DEFAULT_PART_SIZE)
        part = min(max(self.min_part_size, part), MAX_PART_SIZE)
        part -= part % self.part_alignment
        self.part_size = part
        # zero-copy parts hold no buffer, so by default they are larger: fewer requests, ~15 % less CPU
        # per byte than 16 MiB parts. A part size set explicitly applies to them too.
        explicit = part_size is not None or bool(os.environ.get("SPOTGUARD_PART_SIZE", "").strip())
        zpart = env_int("SPOTGUARD_ZERO_COPY_PART_SIZE", part if explicit else DEFAULT_ZERO_COPY_PART_SIZE)
        zpart = min(max(part, zpart), MAX_PART_SIZE)
        self.zero_copy_part_size = zpart - zpart % self.part_alignment
        self.zero_copy_min = max(64 * 1024, min(part, MiB))  # smaller writes are cheaper to copy
        if os.environ.get("SPOTGUARD_ZERO_COPY", "").strip() == "0":
            self.zero_copy = False
        self.concurrency = min(MAX_CONCURRENCY,
                               max(1, concurrency or env_int("SPOTGUARD_UPLOAD_CONCURRENCY", DEFAULT_CONCURRENCY)))
        self.max_attempts = max(1, max_attempts or env_int("SPOTGUARD_MAX_ATTEMPTS", 10))
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self.request_timeout = request_timeout
        self._deadline: float | None = None
        self._deadline_local = threading.local()
        self._pool: BufferPool | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.retries = 0  # requests retried since creation (observability, tests)
        self.bytes_uploaded = 0  # checkpoint bytes durable in the store (parts and small PUTs), since creation
        self.zero_copy_bytes = 0  # of those, bytes in parts sent from the source's memory (not copied)

    def count_uploaded(self, n: int, zero_copy: bool = False) -> None:
        """Progress: ``n`` more bytes of a streamed upload were accepted by the store (thread-safe)."""
        with self._lock:
            self.bytes_uploaded += n
            if zero_copy:
                self.zero_copy_bytes += n

    # -- deadline ----------------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        """The ``time.monotonic()`` instant after which no request may run (None: unbounded)."""
        override = getattr(self._deadline_local, "value", _UNSET)
        return self._deadline if override is _UNSET else override

    @deadline.setter
    def deadline(self, value: float | None) -> None:
        self._deadline = value

    @contextlib.contextmanager
    def deadline_at(self, value: float | None) -> Iterator[None]:
        """Bound every request made inside the block (all threads) by ``value`` (monotonic)."""
        previous = self._deadline
        self._deadline = value
        try:
            yield
        finally:
            self._deadline = previous

    @contextlib.contextmanager
    def thread_deadline(self, value: float | None) -> Iterator[None]:
        """Override the deadline for requests made by this thread only (cleanup after a failure)."""
        previous = getattr(self._deadline_local, "value", _UNSET)
        self._deadline_local.value = value
        try:
            yield
        finally:
            if previous is _UNSET:
                del self._deadline_local.value
            else:
                self._deadline_local.value = previous

    def remaining(self, default: float | None = None) -> float | None:
        """Seconds left before the deadline (may be <= 0), or ``default`` without one."""
        d = self.deadline
        return default if d is None else d - time.monotonic()

    def _check_deadline(self, what: str) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"{self.uri}: deadline passed before {what} ({-left:.2f}s ago)")

    def timeout(self) -> float:
        """Per-request timeout: the configured one, shortened to what is left before the deadline."""
        left = self.remaining()
        t = self.request_timeout if left is None else min(self.request_timeout, left)
        return max(0.05, t)

    # -- retries -----------------------------------------------------------------

    @abc.abstractmethod
    def _retryable(self, exc: BaseException) -> bool:
        """5xx, 429/SlowDown/throttling, timeouts and connection resets."""

    def _translate(self, exc: BaseException, what: str) -> BaseException:
        """Map a final, non-retryable SDK error to FileNotFoundError/ObjectStoreError."""
        return ObjectStoreError(f"{self.uri}: {what} failed: {type(exc).__name__}: {exc}")

    def call(self, what: str, fn: Callable[..., T], *args: Any, attempts: int | None = None, **kwargs: Any) -> T:
        """Run one request with jittered exponential backoff, never past the deadline."""
        attempt = 0
        limit = attempts or self.max_attempts
        while True:
            self._check_deadline(what)
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, StorageError):
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                if not self._retryable(exc):
                    raise self._translate(exc, what) from exc
                attempt += 1
                if attempt >= limit:
                    raise ObjectStoreError(f"{self.uri}: {what} failed after {attempt} attempts: "
                                           f"{type(exc).__name__}: {exc}") from exc
                delay = min(self.backoff_cap, self.backoff * (2 ** (attempt - 1))) * _JITTER.uniform(0.5, 1.0)
                left = self.remaining()
                if left is not None and delay >= left:
                    raise DeadlineExceeded(f"{self.uri}: {what} failed ({type(exc).__name__}: {exc}) and the "
                                           f"deadline leaves {max(left, 0):.2f}s, too little to retry") from exc
                self.retries += 1
                log.info("retrying storage request", storage=self.uri, what=what, attempt=attempt,
                         delay=round(delay, 3), error=f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(delay)

    def wait(self, fut: "Future[T]", what: str) -> T:
        """A future's result, but give up (DeadlineExceeded) at the deadline."""
        left = self.remaining()
        try:
            return fut.result(timeout=None if left is None else max(0.0, left))
        except TimeoutError:
            if fut.done():
                raise
            raise DeadlineExceeded(f"{self.uri}: {what} did not finish before the deadline") from None

    # -- shared resources --------------------------------------------------------

    def pool(self, producers: int = 1) -> BufferPool:
        """The part-buffer pool: (concurrency + producers) buffers of one part each."""
        with self._lock:
            want = self.concurrency + max(1, producers)
            if self._pool is None or self._pool.count < want:
                self._pool = BufferPool(self.part_size, want)
            return self._pool

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="spotguard-io")
            return self._executor

    def open_upload(self, key: str, producers: int = 1) -> UploadStream:
        """A streaming writer for object ``key`` (relative to the root)."""
        return UploadStream(self, self._name(key), self.pool(producers), self.executor(), key=key)

    # -- primitives a backend implements (full names) ---------------------------------

    @abc.abstractmethod
    def _put(self, name: str, data: memoryview, crc: str | None = None) -> None:
        """One whole object in one request. ``crc``: its base64 CRC32C when already known (from the
        stream's block checksums), for the store to check; backends that send one compute it otherwise."""

    @abc.abstractmethod
    def _get(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) (whole object when both None); FileNotFoundError if absent."""

    @abc.abstractmethod
    def _head(self, name: str) -> int | None:
        """The object's size, or None if absent."""

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterable[RawObject]: ...

    @abc.abstractmethod
    def _delete(self, names: list[str]) -> None:
        """Delete these objects (missing ones are fine)."""

    @abc.abstractmethod
    def _start_upload(self, name: str) -> Upload: ...

    @abc.abstractmethod
    def _abort_uploads(self, prefix: str) -> int:
        """Abort every unfinished upload whose object name starts with ``prefix``; returns how many."""

    # -- Storage API ---------------------------------------------------------------

    def _name(self, key: str) -> str:
        check_key(key)
        return self.root + key

    def write_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        digest = digest_of(data)
        crc = _b64(crc32c_of_blocks((digest.block(i) for i in range(FileDigest.block_count(digest.size))),
                                    digest.size))
        self.call(f"put {name}", self._put, name, memoryview(data), crc)
        self.write_log.note(key, digest)

    def read_bytes(self, key: str) -> bytes:
        name = self._name(key)
        return self.call(f"get {name}", self._get, name)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``key`` (a ranged GET)."""
        name = self._name(key)
        if end <= start:
            return b""
        return self.call(f"get {name}[{start}:{end}]", self._get, name, start, end)

    def exists(self, key: str) -> bool:
        name = self._name(key)
        return self.call(f"head {name}", self._head, name) is not None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        full = self.root + prefix
        raw = self.call(f"list {full}", lambda: list(self._list(full)))
        out = [ObjectInfo(key=o.name[len(self.root):], size=o.size, mtime=o.mtime) for o in raw
               if o.name.startswith(full) and o.name != self.root]
        if self.hidden_prefix:
            out = [o for o in out if not o.key.startswith(self.hidden_prefix)]
        out.sort(key=lambda o: o.key)
        return out

    def delete_prefix(self, prefix: str) -> None:
        check_prefix(prefix)
        if not prefix:
            raise StorageError("refusing to delete the whole storage root (empty prefix)")
        self.abort_incomplete_uploads(prefix)
        names = [self.root + o.key for o in self.list(prefix)]
        for i in range(0, len(names), 1000):
            batch = names[i:i + 1000]
            self.call(f"delete {len(batch)} objects under {self.root + prefix}", self._delete, batch)

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort unfinished multipart/block uploads under ``prefix`` (left by a killed save)."""
        check_prefix(prefix)
        n = self.call(f"abort uploads under {self.root + prefix}", self._abort_uploads, self.root + prefix)
        if n:
            log.info("aborted orphaned uploads", storage=self.uri, prefix=prefix, count=n)
        return n

    def dcp_writer(self, key: str, *, thread_count: int | None = None) -> "StorageWriter":
        from .dcp_object import ObjectStoreWriter

        return ObjectStoreWriter(self, key.strip("/"), files_per_rank=thread_count)

    def dcp_reader(self, key: str, digests: "Mapping[str, FileDigest] | None" = None) -> "StorageReader":
        from .dcp_object import ObjectStoreReader

        return ObjectStoreReader(self, key.strip("/"), digests=None if digests is None else dict(digests))


    def download(self, key: str, dest: str | os.PathLike[str]) -> str:
        """Copy committed folder ``key`` to local folder ``dest``: only the files its record names, each verified."""
        from .commit import checkpoint_info
        from .verify import download_checkpoint

        return str(download_checkpoint(self, checkpoint_info(self, key), dest))

    def close(self) -> None:
        """Stop the I/O threads (idempotent)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "part_size": self.part_size, "concurrency": self.concurrency,
                "zero_copy": self.zero_copy}


_UNSET: Any = object()
