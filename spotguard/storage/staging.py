"""Device→host staging through a small pool of host buffers, chunked and overlapped.

Why: ``tensor.cpu()`` of a CUDA tensor is one synchronous copy into pageable
memory that must hold the whole tensor (8 GiB of state = 8 GiB more RSS, at
pageable-copy speed). Here a tensor's bytes are copied ``chunk`` bytes at a
time into ``count`` reusable host buffers (pinned where CUDA exists) on a
separate copy stream; up to ``count`` copies are in flight while the consumer
(the part uploader, or a file write) takes the finished ones in order. Host
memory is bounded by ``count * chunk`` whatever the state's size, and the
device keeps running: the copy stream only waits for the work queued before
the save started, so the training thread's next kernels may run meanwhile
(they must not modify the tensors being staged until the save returns —
DCP's contract, and the hook's, already).

Only ``_Copier`` touches the device: the pool, the chunk plan and the
in-order/back-pressure logic are the same code on a CPU-only machine, where the
copier copies synchronously into ordinary (non-pinned) buffers. That is what the
unit tests exercise; the CUDA calls (pinned allocation, stream, events) only run
on a GPU (``make gpu-check``).

Settings (read once per pool):
  ``$SPOTGUARD_STAGING``            ``auto`` (default: device tensors only), ``off`` (plain ``.cpu()``),
                                    ``all`` (CPU tensors too: tests and measurements only)
  ``$SPOTGUARD_STAGING_BUFFERS``    buffers in the pool (default 4)
  ``$SPOTGUARD_STAGING_CHUNK_MB``   bytes per buffer in MiB (default 32): pool = 128 MiB of host memory
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Iterator

import torch

__all__ = ["HostPool", "Stager", "chunk_spans", "staging_mode", "shared_stager", "copy_to_host", "minimal_storage"]

DEFAULT_BUFFERS = 4
DEFAULT_CHUNK_MB = 32
#: smaller tensors take the plain ``.cpu()`` path: one small synchronous copy costs less than the pool
STAGE_MIN_BYTES = 1 << 20


def staging_mode() -> str:
    """``auto`` | ``off`` | ``all`` from ``$SPOTGUARD_STAGING`` (anything else: ``auto``)."""
    mode = os.environ.get("SPOTGUARD_STAGING", "auto").strip().lower()
    return mode if mode in ("auto", "off", "all") else "auto"


def wants_staging(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the pool (device tensors; CPU ones too under ``all``)."""
    mode = staging_mode()
    if mode == "off" or t.nbytes < STAGE_MIN_BYTES:
        return False
    return t.device.type != "cpu" or mode == "all"


def _env_positive(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        value = int(raw) if raw not in (None, "") else default
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer: set a positive whole number or unset it") from None
    if value < 1:
        raise ValueError(f"${name}={value} must be >= 1")
    return value


def chunk_spans(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` as consecutive ``(offset, length)`` spans of at most ``chunk`` bytes."""
    if chunk < 1 or end < start:
        raise ValueError(f"bad span [{start}, {end}) / chunk {chunk}")
    return [(o, min(chunk, end - o)) for o in range(start, end, chunk)]


class HostPool:
    """``count`` host buffers of ``chunk`` bytes (pinned when asked); blocks when all are lent.

    ``peak_in_use`` records the high-water mark so tests and ``gpu-check`` can
    show the bound holds.
    """

    def __init__(self, count: int, chunk: int, *, pin: bool) -> None:
        if count < 1 or chunk < 1:
            raise ValueError("a staging pool needs >= 1 buffer of >= 1 byte")
        self.count, self.chunk, self.pinned = count, chunk, pin
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._in_use = 0
        self.peak_in_use = 0
        self._cv = threading.Condition()

    def _make(self) -> torch.Tensor:
        return torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.pinned)

    def try_acquire(self, block: bool) -> torch.Tensor | None:
        """A free buffer (allocated lazily, at most ``count``); None if none and not ``block``."""
        with self._cv:
            while not self._free and self._made >= self.count:
                if not block:
                    return None
                self._cv.wait()
            if self._free:
                buf = self._free.pop()
            else:
                self._made += 1
                buf = None
            self._in_use += 1
            self.peak_in_use = max(self.peak_in_use, self._in_use)
        if buf is None:
            try:
                buf = self._make()
            except BaseException:
                with self._cv:
                    self._made -= 1
                    self._in_use -= 1
                    self._cv.notify()
                raise
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.append(buf)
            self._in_use -= 1
            self._cv.notify()

    @property
    def allocated_bytes(self) -> int:
        return self._made * self.chunk


class _Copier:
    """The only device-specific part: start a copy of a device byte range into a host buffer; wait for it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=device) if self.cuda else None
        self._device = device

    def begin(self) -> None:
        """Order the copy stream after everything already queued on the current (training) stream."""
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @staticmethod
    def wait(handle: Any) -> None:
        if handle is not None:
            handle.synchronize()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s whole storage, on its device."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def _dense_extent(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots of its storage with no overlap
    (contiguous in some order of its dims: what ``clone()`` keeps the strides of)."""
    expect = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def minimal_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor as one whose storage is exactly its own bytes, for ``torch.save`` (which writes
    whole storages), without a copy where its bytes are one consecutive run of its storage.

    DCP's writers ``clone()`` such a view (a slice of a bigger tensor, an FSDP2 shard inside its
    padded storage): a host copy of the tensor while it is written. Here the view's byte range
    becomes the storage of a new tensor of the same shape, strides and dtype that shares the memory
    (``torch.frombuffer`` keeps the original storage alive), so torch.save writes the same bytes
    as it would from the clone, from the tensor's own memory. Anything else (a strided view, a
    quantized or exotic tensor, no numpy) still gets the clone.
    """
    t = t.detach()
    st = t.untyped_storage()
    if st.nbytes() == t.nbytes or t.device.type != "cpu":
        return t
    if t.numel() > 0 and not t.is_quantized and t.layout == torch.strided and _dense_extent(t):
        try:
            start = t.storage_offset() * t.element_size()
            raw = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))[start:start + t.nbytes]
            alias = torch.frombuffer(raw.numpy(), dtype=torch.uint8).view(t.dtype)
            alias = alias.as_strided(t.size(), t.stride())
            if alias.untyped_storage().nbytes() == t.nbytes and alias.data_ptr() == t.data_ptr():
                return alias
        except Exception:  # noqa: BLE001, S110 - no numpy, a dtype numpy cannot view: the clone below
            pass
    return t.clone()


class Stager:
    """Streams a tensor's storage bytes to host in order, ``pool.count`` chunk copies in flight."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._copiers: dict[str, _Copier] = {}
        self._lock = threading.Lock()
        self.bytes_staged = 0

    def _copier(self, device: torch.device) -> _Copier:
        with self._lock:
            key = str(device)
            if key not in self._copiers:
                self._copiers[key] = _Copier(device)
            return self._copiers[key]

    def chunks(self, t: torch.Tensor, start: int = 0, end: int | None = None) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` of ``t``'s storage as host memoryviews, in order.

        Each view is valid until the next one is requested (its buffer then goes
        back to the pool): consume (copy, send, write) it before advancing.
        Never holds more than ``pool.count`` buffers; with the pool shared by
        several producers it blocks only when it has nothing in flight itself,
        so producers cannot deadlock each other.
        """
        src = _bytes_of(t)
        end = src.numel() if end is None else end
        copier = self._copier(t.device)
        copier.begin()
        spans = collections.deque(chunk_spans(start, end, self.pool.chunk))
        pending: collections.deque[tuple[torch.Tensor, int, Any]] = collections.deque()
        try:
            while spans or pending:
                while spans and len(pending) < self.pool.count:
                    buf = self.pool.try_acquire(block=not pending)
                    if buf is None:
                        break
                    off, n = spans.popleft()
                    pending.append((buf, n, copier.start(buf[:n], src[off:off + n])))
                buf, n, handle = pending.popleft()
                try:
                    copier.wait(handle)
                    self.bytes_staged += n
                    yield memoryview(buf[:n].numpy())
                finally:
                    self.pool.release(buf)
        finally:
            for buf, _n, handle in pending:  # abandoned early: let queued copies land before reuse
                try:
                    copier.wait(handle)
                finally:
                    self.pool.release(buf)


_shared: dict[tuple[int, int, bool], Stager] = {}
_shared_lock = threading.Lock()


def shared_stager() -> Stager:
    """The process's stager (one pool per settings): pinned memory is allocated once, on first use."""
    count = _env_positive("SPOTGUARD_STAGING_BUFFERS", DEFAULT_BUFFERS)
    chunk = _env_positive("SPOTGUARD_STAGING_CHUNK_MB", DEFAULT_CHUNK_MB) * 1024 * 1024
    pin = torch.cuda.is_available()
    with _shared_lock:
        key = (count, chunk, pin)
        if key not in _shared:
            _shared[key] = Stager(HostPool(count, chunk, pin=pin))
        return _shared[key]


def copy_to_host(t: torch.Tensor, stager: Stager | None = None) -> torch.Tensor:
    """A CPU copy of ``t`` (same shape, strides, dtype) filled chunk by chunk through the pool.

    For snapshots that must outlive the step (periodic saves): the destination
    is ordinary memory of the tensor's size; the pool makes the device side a
    pinned, overlapped copy instead of one synchronous pageable one.
    """
    stager = stager or shared_stager()
    storage_bytes = t.untyped_storage().nbytes()
    if t.storage_offset() != 0 or storage_bytes != t.nbytes:
        t = t.clone()
        storage_bytes = t.untyped_storage().nbytes()
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    dst = _bytes_of(out)
    if dst.numel() != storage_bytes:  # an exotic layout: the plain path is always right
        return t.to("cpu", copy=True)
    pos = 0
    for view in stager.chunks(t):
        n = len(view)
        dst[pos:pos + n].copy_(torch.frombuffer(view, dtype=torch.uint8))
        pos += n
    return out
