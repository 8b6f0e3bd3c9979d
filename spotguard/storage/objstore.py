"""What every object-store backend shares: deadline-bounded retries, pooled part buffers, streaming uploads.

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
import base64
import contextlib
import hashlib
import io
import os
import queue
import random
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from ..logs import get_logger
from .base import ObjectInfo, Storage, StorageError, check_key, check_prefix
from .integrity import Checksummer, FileDigest, crc32c_b64, crc32c_of_blocks, digest_of

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

__all__ = [
    "ObjectStoreError",
    "DeadlineExceeded",
    "ObjectStorage",
    "Upload",
    "UploadStream",
    "BufferPool",
    "MemReader",
    "Segments",
    "SegmentReader",
    "StagedSource",
    "ZeroCopySource",
    "env_int",
    "request_body",
]

T = TypeVar("T")
log = get_logger("spotguard.storage")

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


# Retry jitter from a private generator: a periodic upload retries in a background thread while
# the job trains, and drawing from the global `random` would change the training's random stream
# (found by the chaos run: the resumed job then diverges from an uninterrupted one).
_JITTER = random.Random()


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


# --- memory -------------------------------------------------------------------


class _MemoryFile(io.RawIOBase):
    """What both memory-backed readers share: read-only, seekable, ``len()`` = ``_size`` bytes."""

    _size = 0
    _pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _seek_target(self, offset: int, whence: int) -> int:
        return {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence] + offset


class MemReader(_MemoryFile):
    """A read-only, seekable file over a memoryview: SDKs that want a stream get one without a copy."""

    def __init__(self, data: memoryview | bytes | bytearray) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._size = len(self._mv)
        self._pos = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, self._seek_target(offset, whence))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        if n <= 0:
            return 0
        memoryview(b).cast("B")[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = self._mv[self._pos:end].tobytes()
        self._pos = end
        return out


def body_of(data: "memoryview | Segments") -> Any:
    """A request body for ``data`` that HTTP clients send with one ``sendall``.

    A full pooled buffer goes as the bytearray itself (no copy); file-like
    bodies would be sent in 8-16 KiB reads, each a copy and a Python call.
    (``Segments`` — zero-copy parts — only reach backends with
    ``zero_copy = True``, which send them with ``SegmentReader``; joined here
    as a fallback.)
    """
    if isinstance(data, Segments):
        return bytes(data)
    obj = data.obj
    if isinstance(obj, (bytes, bytearray)) and len(data) == len(obj) and data.contiguous:
        return obj
    return data.tobytes()


def _b64(crc: int) -> str:
    """A CRC32C in the stores' wire form: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def part_md5(data: "memoryview | Segments | bytes") -> str:
    """The base64 MD5 of a part (Azure ``Content-MD5``), from its memory ranges without joining them.
    Runs in the sending thread; hashlib releases the GIL on large buffers."""
    h = hashlib.md5(usedforsecurity=False)
    for v in data.views if isinstance(data, Segments) else [data]:
        h.update(v)
    return base64.b64encode(h.digest()).decode("ascii")


def part_crc32c(data: "memoryview | Segments | bytes") -> str:
    """The base64 CRC32C of a part (S3 ``x-amz-checksum-crc32c``, GCS ``x-goog-hash: crc32c=``): the
    store recomputes it and refuses a body damaged in transit. Runs in the sending thread (GIL released)."""
    return crc32c_b64(data.views if isinstance(data, Segments) else [data])


def request_body(data: "memoryview | Segments") -> Any:
    """A part's request body, never a copy of a large part.

    A whole pooled buffer goes as the bytearray itself; small data is copied
    once (cheaper than a file-like body); anything else — tensor memory,
    ``Segments`` — as a ``SegmentReader`` that hands the HTTP client views of
    the ranges. Build one per attempt: a retry must start from byte 0. For
    clients that send a file-like body with ``sendall`` per ``read``
    (botocore/urllib3, requests); not for SDK calls that ``read()`` the whole
    body into ``bytes`` (azure-storage-blob's ``upload_blob``).
    """
    if isinstance(data, memoryview) and isinstance(data.obj, (bytes, bytearray)) and len(data) == len(data.obj):
        return body_of(data)
    if len(data) < 64 * 1024:
        return body_of(data)
    return SegmentReader(data)


class Segments:
    """One part made of several memory ranges, sent back to back without joining them (zero-copy).

    ``len()`` is the total size and ``bytes()`` joins them, so code written for
    a ``memoryview`` part mostly works unchanged.
    """

    __slots__ = ("views", "nbytes")

    def __init__(self, views: Iterable[memoryview]) -> None:
        self.views = tuple(v for v in views if len(v))
        self.nbytes = sum(len(v) for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.views)

    def tobytes(self) -> bytes:
        return bytes(self)


class SegmentReader(_MemoryFile):
    """A seekable file over ``Segments`` whose ``read`` returns memoryviews of the ranges, not copies.

    ``read(n)`` returns up to ``max(n, READ_CHUNK)`` bytes, never across a
    range boundary: urllib3 asks for 16 KiB blocks, and one ``sendall`` per
    16 KiB costs twice the CPU of 4 MiB sends. Every reader of a request body
    (urllib3, botocore's hashing and chunked-checksum wrappers) uses the
    length it gets, not the one it asked for.
    """

    READ_CHUNK = 4 * MiB

    def __init__(self, data: "Segments | memoryview") -> None:
        super().__init__()
        views = data.views if isinstance(data, Segments) else (memoryview(data).cast("B"),)
        self._views = views
        self._starts: list[int] = []
        pos = 0
        for v in views:
            self._starts.append(pos)
            pos += len(v)
        self._size = pos
        self._pos = 0
        self._seg = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = min(max(0, self._seek_target(offset, whence)), self._size)
        self._seg = 0
        while self._seg + 1 < len(self._views) and self._starts[self._seg + 1] <= self._pos:
            self._seg += 1
        return self._pos

    def _next(self, limit: int) -> memoryview | bytes:
        """Up to ``limit`` bytes from the current range (a view, no copy); b"" at the end."""
        while self._seg < len(self._views) and self._pos >= self._starts[self._seg] + len(self._views[self._seg]):
            self._seg += 1
        if self._seg >= len(self._views):
            return b""
        off = self._pos - self._starts[self._seg]
        out = self._views[self._seg][off:off + limit]
        self._pos += len(out)
        return out

    def read(self, size: int | None = -1) -> Any:
        if size is None or size < 0:  # everything left, joined (nobody sending a body does this)
            parts = []
            while chunk := self._next(self._size):
                parts.append(chunk)
            return b"".join(parts)
        return self._next(max(size, self.READ_CHUNK))

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = 0
        while n < len(dst):
            chunk = self._next(len(dst) - n)
            if not chunk:
                break
            dst[n:n + len(chunk)] = chunk
            n += len(chunk)
        return n


class BufferPool:
    """At most ``count`` reusable part buffers of ``size`` bytes: the upload memory bound.

    Why reuse: first-touch page faults cost more than the copy itself on many
    VMs; a warm pool makes the second checkpoint as fast as a memcpy.
    """

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.count = count
        self._free: "queue.LifoQueue[bytearray]" = queue.LifoQueue()
        self._made = 0
        self._lock = threading.Lock()

    def acquire(self, timeout: float | None) -> bytearray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._made < self.count:
                self._made += 1
                return bytearray(self.size)
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise DeadlineExceeded("timed out waiting for an upload buffer (uploads too slow for the deadline)") from None

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)

    @property
    def allocated_bytes(self) -> int:
        return self._made * self.size


# --- uploads --------------------------------------------------------------------


class Upload(abc.ABC):
    """One object being written in numbered parts (S3 multipart / Azure blocks / GCS resumable)."""

    #: parts must be sent one after another, in order (GCS resumable)
    ordered: bool = False

    @abc.abstractmethod
    def part(self, number: int, data: memoryview, last: bool) -> Any:
        """Send part ``number`` (1-based); returns a token ``complete`` needs. Must be retry-safe."""

    @abc.abstractmethod
    def complete(self, tokens: list[Any], total: int) -> None:
        """Make the object visible, atomically, from the parts in order."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard every part sent so far (no orphaned parts left billing)."""

    def expect_crc(self, number: int, crc_b64: str) -> None:
        """Part ``number``'s CRC32C, already known from the stream's block checksums (no second pass)."""
        self.__dict__.setdefault("_crcs", {})[number] = crc_b64

    def crc_of(self, number: int, data: "memoryview | Segments") -> str:
        """Part ``number``'s base64 CRC32C for the store to check: known already, else computed now."""
        return self.__dict__.get("_crcs", {}).get(number) or part_crc32c(data)


class ZeroCopySource(abc.ABC):
    """Memory a stream may send from directly instead of copying (see ``UploadStream.zero_copy``)."""

    @abc.abstractmethod
    def view_of(self, data: memoryview) -> memoryview | None:
        """A view of the same bytes as ``data`` that keeps their owner alive, or None if ``data`` is
        not (wholly) inside this source."""


class StagedSource(abc.ABC):
    """Device bytes a stream writes in place of a placeholder's (see ``UploadStream.staged``)."""

    @abc.abstractmethod
    def chunks_for(self, data: memoryview) -> Iterable[memoryview] | None:
        """The real bytes for ``data`` (a range of the placeholder) in order, or None if ``data``
        is not (wholly) inside the placeholder."""


class UploadStream(io.RawIOBase):
    """A write-only stream that turns ``write`` calls into parallel part uploads.

    Bytes are copied into pooled part buffers, except inside ``zero_copy(source)``
    on a backend that supports it (``ObjectStorage.zero_copy``): a large write
    that lies in ``source``'s memory is not copied but sent straight from it —
    a part is then a list of memory ranges (``Segments``), e.g. the end of one
    tensor, the next record's header (copied, a few hundred bytes) and the start
    of the next tensor. Those parts are ``zero_copy_part_size`` long.

    Small objects (under one part) become a single PUT on ``close``. Memory is
    bounded by the pool and by the number of zero-copy parts in flight; a
    producer blocks for a free buffer or slot (back-pressure). Any part
    failure, or the deadline, fails the next ``write``/``close``; the caller
    then calls ``abort``.
    """

    def __init__(self, store: "ObjectStorage", name: str, pool: BufferPool, executor: ThreadPoolExecutor,
                 key: str | None = None) -> None:
        super().__init__()
        self._store = store
        self._name = name
        self._key = key  # relative key: what the store's write log records on close
        self._sum = Checksummer()  # the file's checksum, computed as the bytes go out
        self._part_off = 0  # file offset of the part being built
        self._pool = pool
        self._executor = executor
        # the part being built: finished ranges, the pool buffers they use, the active copy buffer
        self._views: list[memoryview] = []
        self._bufs: list[bytearray] = []
        self._buf: bytearray | None = None  # active pool buffer; [_bstart:_fill] belongs to this part
        self._bstart = 0
        self._fill = 0
        self._small: bytearray | None = None  # copied bytes between zero-copy ranges (headers)
        self._plen = 0
        self._zc = False  # this part holds zero-copy ranges (target: zero_copy_part_size)
        self._source: ZeroCopySource | None = None
        self._staged: StagedSource | None = None
        self._slots = threading.BoundedSemaphore(store.concurrency + 2)  # zero-copy parts in flight
        self._pos = 0
        self._upload: Upload | None = None
        self._futures: list[Future[Any]] = []
        self._lane: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._done = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        for f in self._futures:
            if f.done() and f.exception() is not None:
                self._error = f.exception()
                raise self._error  # type: ignore[misc]

    @property
    def error(self) -> BaseException | None:
        """The first failure (a part upload, the deadline); torch.save may mask it with its own error."""
        return self._error

    @contextlib.contextmanager
    def zero_copy(self, source: ZeroCopySource | None) -> Iterator[None]:
        """Inside the block, large writes of ``source``'s bytes are sent from its memory, not copied.

        The caller guarantees those bytes do not change until ``close`` returns
        (every part is then uploaded): DCP's contract already, since
        ``write_data`` only returns after ``close`` and the state is not
        modified during ``save`` (the hook saves at a step boundary with
        training blocked, or from a staged CPU copy). Each part keeps the
        source's owner alive until it is sent, so a part still in flight after
        ``abort`` never reads freed memory. No-op where the backend cannot
        send a list of ranges, or ``$SPOTGUARD_ZERO_COPY=0``.
        """
        if source is None or not self._store.zero_copy:
            yield
            return
        previous, self._source = self._source, source
        try:
            yield
        finally:
            self._source = previous

    @contextlib.contextmanager
    def staged(self, source: "StagedSource | None") -> Iterator[None]:
        """Inside the block, a write that lies in ``source``'s placeholder memory is replaced by the
        bytes ``source`` streams from the device (chunk by chunk, through the staging pool).

        Unlike ``zero_copy`` this works on every backend: the chunks are copied
        into the part buffers, so host memory stays at the pool plus the parts.
        """
        previous, self._staged = self._staged, source
        try:
            yield
        finally:
            self._staged = previous

    def write(self, b: Any) -> int:
        try:
            return self._write(b)
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            raise

    def _write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if self._done:
            raise ValueError(f"write to a finished upload of {self._name}")
        if self._staged is not None:
            chunks = self._staged.chunks_for(mv)
            if chunks is not None:
                for chunk in chunks:
                    self._sum.update(chunk)
                    self._copy(chunk)
                self._pos += n
                return n
        self._sum.update(mv)
        view = None
        if self._source is not None and n >= self._store.zero_copy_min:
            view = self._source.view_of(mv)
        if view is not None:
            self._append_view(view)
        else:
            self._copy(mv)
        self._pos += n
        return n

    def _target(self) -> int:
        return self._store.zero_copy_part_size if self._zc else self._store.part_size

    def _freeze(self) -> None:
        """Close the active copy region into a finished range of this part."""
        if self._buf is not None:
            if self._fill > self._bstart:
                self._views.append(memoryview(self._buf)[self._bstart:self._fill])
            self._bstart = self._fill
            if self._fill == len(self._buf) or self._zc:
                self._buf = None  # full, or this part now continues in _small
        if self._small is not None:
            if self._small:
                self._views.append(memoryview(self._small))
            self._small = None

    def _copy(self, mv: memoryview) -> None:
        n = len(mv)
        done = 0
        while done < n:
            take = min(n - done, self._target() - self._plen)
            if self._zc:  # a few header bytes between zero-copy ranges: no pool buffer for those
                if self._small is None:
                    self._small = bytearray()
                self._small += mv[done:done + take]
            else:
                if self._buf is None or self._fill == len(self._buf):
                    self._freeze()
                    self._raise_if_failed()
                    self._buf = self._pool.acquire(self._store.remaining(default=None))
                    self._bufs.append(self._buf)
                    self._fill = self._bstart = 0
                take = min(take, len(self._buf) - self._fill)
                self._buf[self._fill:self._fill + take] = mv[done:done + take]
                self._fill += take
            self._plen += take
            done += take
            if self._plen == self._target():
                self._send(last=False)

    def _append_view(self, view: memoryview) -> None:
        self._zc = True
        self._freeze()
        done, n = 0, len(view)
        while done < n:
            take = min(n - done, self._target() - self._plen)
            self._views.append(view[done:done + take])
            self._plen += take
            done += take
            if self._plen == self._target():
                self._send(last=False)
                self._zc = done < n  # the rest of this range starts the next part

    def _take_part(self) -> tuple[Any, list[bytearray], bool, int]:
        """Detach the part being built: (data, its pool buffers, zero-copy?, length)."""
        self._freeze()
        views, bufs, zc, length = self._views, self._bufs, self._zc, self._plen
        self._views, self._bufs, self._buf, self._small = [], [], None, None
        self._fill = self._bstart = self._plen = 0
        self._zc = False
        if zc:
            return Segments(views), bufs, True, length
        return (views[0] if views else memoryview(b"")), bufs, False, length

    def _release(self, bufs: list[bytearray]) -> None:
        for b in bufs:
            self._pool.release(b)

    def _send(self, last: bool) -> None:
        data, bufs, zc, length = self._take_part()
        slot = False
        try:
            if zc:  # bound the zero-copy parts queued or in flight (they pin their source's memory)
                self._raise_if_failed()
                left = self._store.remaining(default=None)
                slot = self._slots.acquire(timeout=None if left is None else max(0.0, left))
                if not slot:
                    raise DeadlineExceeded(f"{self._store.uri}: timed out waiting for a part upload slot "
                                           f"(uploads too slow for the deadline)")
            if self._upload is None:
                self._upload = self._store.call("start upload", self._store._start_upload, self._name)
                if self._upload.ordered:
                    self._lane = ThreadPoolExecutor(1, thread_name_prefix="spotguard-lane")
        except BaseException:
            if slot:
                self._slots.release()
            self._release(bufs)
            raise
        number = len(self._futures) + 1
        upload = self._upload
        crc = self._sum.crc_of_span(self._part_off, self._part_off + length)  # from the block CRCs
        if crc is not None:
            upload.expect_crc(number, _b64(crc))
        self._part_off += length

        def send() -> Any:
            try:
                token = self._store.call(f"part {number} of {self._name}", upload.part, number, data, last)
                self._store.count_uploaded(length, zero_copy=zc)
                return token
            finally:
                self._release(bufs)
                if zc:
                    self._slots.release()

        self._futures.append((self._lane or self._executor).submit(send))

    def close(self) -> None:
        """Finish the object: durable and visible on return (or raise; then call ``abort``)."""
        if self._done or self.closed:
            return
        self._raise_if_failed()
        if self._upload is None:
            data, bufs, _zc, length = self._take_part()
            crc = self._sum.crc_of_span(0, length)  # the whole object, from the block CRCs
            try:
                self._store.call(f"put {self._name}", self._store._put, self._name, data,
                                 None if crc is None else _b64(crc))
                self._store.count_uploaded(length)
            finally:
                self._release(bufs)
        else:
            if self._plen:
                self._send(last=True)
            else:
                _data, bufs, _zc, _n = self._take_part()
                self._release(bufs)
            tokens = [self._store.wait(f, f"upload of {self._name}") for f in self._futures]
            self._store.call(f"complete {self._name}", self._upload.complete, tokens, self._pos)
        self._done = True
        self._source = None
        if self._key is not None:
            self._store.write_log.note(self._key, self._sum.digest())
        if self._lane is not None:
            self._lane.shutdown(wait=False)
        super().close()

    def abort(self) -> None:
        """Best effort: stop, wait briefly for parts in flight, discard every part sent."""
        if self._done:
            return
        self._done = True
        self._source = None
        for f in self._futures:
            f.cancel()
        grace = time.monotonic() + 3.0
        for f in self._futures:
            with contextlib.suppress(BaseException):
                f.result(timeout=max(0.0, grace - time.monotonic()))
        _data, bufs, _zc, _n = self._take_part()
        self._release(bufs)
        if self._upload is not None:
            try:
                with self._store.thread_deadline(None):  # cleanup may outlive the notice by a little
                    self._store.call(f"abort {self._name}", self._upload.abort, attempts=3)
                log.info("aborted unfinished upload", object=self._name, parts=len(self._futures))
            except Exception as exc:  # noqa: BLE001 - the next prepare_attempt cleans orphans
                log.warning("could not abort upload (the next save cleans it up)", object=self._name,
                            error=repr(exc))
        if self._lane is not None:
            self._lane.shutdown(wait=False)
        with contextlib.suppress(Exception):
            super().close()


# --- the base storage -------------------------------------------------------------


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


def missing_extra(what: str, extra: str, exc: BaseException) -> StorageError:
    """The error for a backend whose optional SDK is not installed."""
    return StorageError(f"{what} needs the optional dependencies of spotguard[{extra}] "
                        f"({exc}): pip install 'spotguard[{extra}]'")
