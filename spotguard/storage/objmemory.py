"""Part memory for object-store uploads: pooled part buffers, parts made of several memory ranges
(``Segments``, zero-copy), read-only file views over them (``MemReader``, ``SegmentReader``) and the
request bodies and per-part checksums the backends send. No I/O here: the streams (``objupload.py``)
and the backends use these."""

from __future__ import annotations

import base64
import hashlib
import io
import queue
import threading
from typing import Any, Iterable

from .integrity import crc32c_b64
from .objcommon import DeadlineExceeded, MiB

__all__ = ["BufferPool", "MemReader", "Segments", "SegmentReader", "body_of", "part_md5", "part_crc32c",
           "request_body"]


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
