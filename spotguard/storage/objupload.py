"""Streaming uploads: the ``Upload`` a backend implements (numbered parts, complete, abort) and the
``UploadStream`` that turns ``write`` calls into parallel, bounded, checksummed part uploads — copied
into pooled buffers, or sent straight from a ``ZeroCopySource`` / ``StagedSource``."""

from __future__ import annotations

import abc
import contextlib
import io
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Protocol, TypeVar

from ..logs import get_logger
from .integrity import Checksummer
from .objcommon import DeadlineExceeded
from .objmemory import BufferPool, Segments, _b64, part_crc32c

if TYPE_CHECKING:
    from .integrity import WriteLog

__all__ = ["Upload", "UploadStream", "StagedSource", "ZeroCopySource", "PartSink"]

T = TypeVar("T")
log = get_logger("spotguard.storage")


class PartSink(Protocol):
    """What a stream needs of its store (``ObjectStorage`` is one): written here so that this module does
    not import the base storage, which imports it."""

    uri: str
    part_size: int
    concurrency: int
    zero_copy: bool
    zero_copy_min: int
    zero_copy_part_size: int
    write_log: "WriteLog"

    def call(self, what: str, fn: Callable[..., T], *args: Any, attempts: int | None = None, **kwargs: Any) -> T: ...

    def wait(self, fut: "Future[T]", what: str) -> T: ...

    def remaining(self, default: float | None = None) -> float | None: ...

    def thread_deadline(self, value: float | None) -> ContextManager[None]: ...

    def count_uploaded(self, n: int, zero_copy: bool = False) -> None: ...

    def _put(self, name: str, data: memoryview, crc: str | None = None) -> None: ...

    def _start_upload(self, name: str) -> "Upload": ...


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

    def __init__(self, store: PartSink, name: str, pool: BufferPool, executor: ThreadPoolExecutor,
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
