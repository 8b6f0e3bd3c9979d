"""``torch.distributed.checkpoint`` writer/reader that stream to and from an object store.

Why not FsspecWriter: it writes each shard file as one sequential stream (s3fs
buffers and uploads parts one at a time), so one rank never uses more than one
connection. Here each rank serialises its write items into an
``UploadStream`` whose parts go out in parallel; nothing is staged on local
disk. A tensor's bytes are not even copied where the backend allows it (S3):
torch.save hands the stream the storage's own memory in one write, and the
parts are sent from it (``_TensorSource``; safe because ``write_data`` returns
only once every part is uploaded, and DCP's state is not modified during a
save). Memory stays at (concurrency + producers) part buffers plus the tensors
that in-flight parts keep alive (only temporaries cost extra, one tensor's size
while it is written: a GPU→CPU copy with staging off, the clone of a strided
view; a view that is one run of a bigger storage, such as an FSDP2 shard in its
padded storage, is aliased, not cloned: ``staging.minimal_storage``).

The on-store layout is exactly ``FileSystemWriter``'s (``__<rank>_<n>.distcp``
files of ``torch.save`` records plus a pickled ``.metadata`` written by the
coordinator), so a downloaded folder loads with the stock ``FileSystemReader``
and the hook's commit protocol is unchanged: DCP's ``finish`` (``.metadata``)
runs only after every rank's uploads completed, and rank 0 writes
``COMMIT.json`` after that.

Uses a few private helpers of ``torch.distributed.checkpoint.filesystem``
(``_split_by_size_and_type``, ``_write_item``, ``_StorageInfo``, ``_StoragePrefix``)
so the byte format cannot drift from the stock writer's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
import uuid
from concurrent.futures import Future as CFuture
from typing import TYPE_CHECKING, Any, Iterator, cast

import torch
import torch.utils.serialization  # noqa: F401 - the save config lives here (torch >= 2.6)
from torch.distributed.checkpoint.filesystem import (
    _split_by_size_and_type,
    _StoragePrefix,
    _StorageWriterTransforms,
    _write_item,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..logs import get_logger
from .base import StorageError, join_key
from .dcp_items import METADATA, Group, load_items, parse_metadata, read_groups, recorded_digest
from .integrity import BLOCK_SIZE, DamagedCheckpoint, FileDigest, verify_span
from .objupload import StagedSource, UploadStream, ZeroCopySource
from .staging import Stager, minimal_storage, shared_stager, wants_staging

if TYPE_CHECKING:
    from .objstore import ObjectStorage

__all__ = ["ObjectStoreWriter", "ObjectStoreReader", "METADATA_NAME"]

METADATA_NAME = METADATA
SUFFIX = ".distcp"
log = get_logger("spotguard.storage")


def _cpu_tensor(data: torch.Tensor) -> torch.Tensor:
    """The item's tensor on CPU with minimal storage (torch.save writes whole storages); a CPU view
    of a bigger storage is aliased, not cloned, where its bytes are one run (``minimal_storage``)."""
    return minimal_storage(data.detach().cpu())


class _TensorSource(ZeroCopySource):
    """A CPU tensor's storage as a zero-copy source: torch.save writes the storage in one call,
    from its own memory, and that write is sent from the tensor instead of copied into part buffers.

    The view is a uint8 numpy array over the storage, so each part that uses it keeps the tensor
    alive until the part is sent (a temporary ``.cpu()``/clone copy included).
    """

    def __init__(self, view: memoryview, address: int, np: Any) -> None:
        self.view, self.address, self._np = view, address, np

    @classmethod
    def of(cls, t: torch.Tensor, min_bytes: int) -> "_TensorSource | None":
        try:
            import numpy as np

            st = t.untyped_storage()
            n = st.nbytes()
            if t.device.type != "cpu" or n < min_bytes:
                return None
            arr = torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,)).numpy()
            return cls(memoryview(arr), int(arr.__array_interface__["data"][0]), np)
        except Exception:  # noqa: BLE001 - no numpy, an exotic tensor: copy as before
            return None

    def view_of(self, data: memoryview) -> memoryview | None:
        try:
            addr = int(self._np.frombuffer(data, dtype=self._np.uint8).__array_interface__["data"][0])
        except Exception:  # noqa: BLE001
            return None
        off = addr - self.address
        if off < 0 or off + len(data) > len(self.view):
            return None
        return self.view[off:off + len(data)]


def _address(np: Any, data: memoryview) -> int | None:
    try:
        return int(np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0])
    except Exception:  # noqa: BLE001 - not a plain byte buffer
        return None


class _StagedTensor(StagedSource):
    """A device tensor saved through a CPU placeholder of the same layout that is never filled:
    torch.save writes the placeholder's storage, and the stream swaps in the device's bytes,
    staged chunk by chunk through the pinned pool (``staging.py``), so no full host copy exists.

    ``check`` fails the save unless every byte of the storage was swapped in (a torch
    that wrote the storage in some other way must never leave placeholder bytes in a checkpoint).
    """

    def __init__(self, device_tensor: torch.Tensor, placeholder: torch.Tensor, stager: Stager, np: Any,
                 base: int = 0) -> None:
        self.device_tensor, self.placeholder, self.stager, self._np = device_tensor, placeholder, stager, np
        self.base = base  # where the placeholder's first byte lies in the device tensor's storage
        self.nbytes = placeholder.untyped_storage().nbytes()
        self.address = placeholder.untyped_storage().data_ptr()
        self.filled = 0

    @classmethod
    def of(cls, data: torch.Tensor) -> "_StagedTensor | None":
        if os.environ.get("SPOTGUARD_CRC32") == "1":  # torch.save would checksum the placeholder
            return None
        try:
            import numpy as np
        except ImportError:
            return None
        t = data.detach()
        if not wants_staging(t):
            return None
        # Never a device clone (a full GPU at preemption time must not fail the save with an OOM):
        # a whole storage keeps its layout, a contiguous view stages its byte range, anything else
        # takes the plain .cpu() path.
        if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
            base, placeholder = 0, torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        elif t.is_contiguous():
            base, placeholder = t.storage_offset() * t.element_size(), torch.empty(t.size(), dtype=t.dtype)
        else:
            return None
        if placeholder.untyped_storage().nbytes() != t.nbytes:
            return None
        return cls(t, placeholder, shared_stager(), np, base)

    def chunks_for(self, data: memoryview) -> Iterator[memoryview] | None:
        addr = _address(self._np, data)
        if addr is None:
            return None
        off = addr - self.address
        if off < 0 or off + len(data) > self.nbytes:
            return None
        self.filled += len(data)
        return self.stager.chunks(self.device_tensor, self.base + off, self.base + off + len(data))

    def check(self, name: str) -> None:
        if self.filled != self.nbytes:
            raise StorageError(f"staging {name}: torch.save wrote {self.filled} of {self.nbytes} storage bytes "
                               "through the stream; set SPOTGUARD_STAGING=off to save with .cpu()")


def _save_config() -> Any:
    return getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "save", None)


def _crc32_skippable() -> bool:
    """Whether ``_no_crc32`` turns torch.save's CRC32 off (a torch with the setting, no ``$SPOTGUARD_CRC32=1``)."""
    cfg = _save_config()
    return cfg is not None and hasattr(cfg, "compute_crc32") and os.environ.get("SPOTGUARD_CRC32") != "1"


@contextlib.contextmanager
def _no_crc32() -> Iterator[bool]:
    """Skip torch.save's per-record CRC32 while we serialise (``$SPOTGUARD_CRC32=1`` keeps it).

    Why: on one core the CRC runs at ~1.5 GiB/s, slower than the copy into part
    buffers (~4 GiB/s) and than a 10 Gbit/s NIC: it is the save's bottleneck.
    ``torch.load`` reads records without one; the commit record checks sizes
    and the transport (TLS/HTTP) checks the bytes. Process-wide while the save
    runs, which only makes a concurrent ``torch.save`` skip its CRC too.

    torch's config overrides are thread-local: enter it in every thread that
    runs torch.save (a producer thread does not inherit its parent's setting).
    """
    cfg = _save_config()
    if not _crc32_skippable():
        yield False
        return
    previous = cfg.compute_crc32
    cfg.compute_crc32 = False
    try:
        yield True  # torch.save skips the CRC while inside
    finally:
        cfg.compute_crc32 = previous


class ObjectStoreWriter(StorageWriter):
    """Streams each rank's shards to ``<storage>/<key>/`` as parallel part uploads."""

    def __init__(self, storage: ObjectStorage, key: str, *, files_per_rank: int | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.key = key
        self.files_per_rank = max(1, files_per_rank or 1)
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.transforms = _StorageWriterTransforms(None)
        self.bytes_written = 0

    # -- StorageWriter protocol ---------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _no_crc32():
            return self._write_data(plan, planner)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        buckets = [b for b in _split_by_size_and_type(self.files_per_rank, plan.items) if b] or [[]]
        jobs = [(f"{prefix}{i}{SUFFIX}", b) for i, b in enumerate(buckets)]
        results: list[list[WriteResult]] = [[] for _ in jobs]
        errors: list[BaseException] = []
        streams: list[UploadStream] = []
        lock = threading.Lock()
        zero_copy = self.storage.zero_copy
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Producer threads stage device tensors on their own copy streams: first let every kernel
            # already queued (on any stream of the training thread) finish writing the state.
            torch.cuda.synchronize()

        def produce(idx: int, file_name: str, items: list[WriteItem]) -> None:
            with _no_crc32():  # thread-local: each producer thread sets its own
                _produce(idx, file_name, items)

        def _produce(idx: int, file_name: str, items: list[WriteItem]) -> None:
            stream = self.storage.open_upload(join_key(self.key, file_name), producers=len(jobs))
            with lock:
                streams.append(stream)
            try:
                out: list[WriteResult] = []
                for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
                    out.append(_write_item(self.transforms, stream, planner.resolve_data(item), item,
                                           file_name, SerializationFormat.TORCH_SAVE))
                for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
                    data = cast(torch.Tensor, planner.resolve_data(item))  # resolved once: may cost work
                    staged = _StagedTensor.of(data)
                    if staged is not None:  # a device tensor: streamed through the pinned pool
                        with stream.staged(staged):
                            out.append(_write_item(self.transforms, stream, staged.placeholder, item,
                                                   file_name, SerializationFormat.TORCH_SAVE))
                        staged.check(item.index.fqn)
                    else:
                        tensor = _cpu_tensor(data)
                        source = _TensorSource.of(tensor, self.storage.zero_copy_min) if zero_copy else None
                        with stream.zero_copy(source):
                            out.append(_write_item(self.transforms, stream, tensor, item,
                                                   file_name, SerializationFormat.TORCH_SAVE))
                        del tensor, source
                    del data, staged
                    if errors:
                        raise errors[0]
                stream.close()
                results[idx] = out
            except BaseException as exc:
                with lock:  # torch.save reports a failed write as its own RuntimeError: keep the cause
                    errors.append(stream.error or exc)
                stream.abort()

        threads = [threading.Thread(target=produce, args=(i, n, b), name=f"spotguard-save-{i}")
                   for i, (n, b) in enumerate(jobs[1:], start=1)]
        for t in threads:
            t.start()
        produce(0, *jobs[0])
        for t in threads:
            t.join()
        if errors:
            for s in streams:  # a sibling may have finished parts: abort what is not complete
                s.abort()
            raise errors[0]
        flat = [r for rs in results for r in rs]
        self.bytes_written = sum(s.tell() for s in streams)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(flat)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only, after every rank's uploads completed: write ``.metadata`` (one atomic PUT)."""
        metadata.version = "1.0.0"
        storage_md: dict[Any, Any] = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.storage.write_bytes(join_key(self.key, METADATA_NAME), pickle.dumps(metadata))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return f"{self.storage.uri}/{self.key}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # constructed explicitly, never picked by URI sniffing


class ObjectStoreReader(StorageReader):
    """Loads a checkpoint with parallel ranged GETs, bounded in-flight memory.

    With ``digests`` (the commit record's checksums) reads are widened to whole
    checksum blocks and every block is checked as it arrives, before any of its
    bytes is deserialised: no second read of the data.
    """

    def __init__(self, storage: ObjectStorage, key: str, *, digests: "dict[str, FileDigest] | None" = None,
                 window_bytes: int | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.key = key
        self.digests = digests
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        # in-flight read budget; groups of items are fetched as ranges up to one part each
        self.window_bytes = window_bytes or max(4 * storage.part_size, storage.concurrency * storage.part_size)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = self.storage.read_bytes(join_key(self.key, METADATA_NAME))
        return parse_metadata(raw, self.digests, self.checkpoint_id, self.load_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if self.storage_data is None:
            raise AssertionError("storage_data must not be None in metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str:
        return f"{self.storage.uri}/{self.key}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _groups(self, plan: LoadPlan) -> list[Group]:
        """Read items coalesced into (file, start, end, items) spans of about one part each."""
        return read_groups(plan, self.storage_data, self._digest, self.storage.part_size, self.checkpoint_id)

    def _digest(self, path: str) -> FileDigest | None:
        """The record's checksum of ``path`` (None when not verifying); unsafe or unrecorded names are damage."""
        return recorded_digest(self.digests, path, self.checkpoint_id)

    def _fetch(self, path: str, start: int, end: int) -> CFuture[memoryview]:
        """Fetch [start, end) as parallel ranged GETs of at most one part each, into one buffer."""
        ex = self.storage.executor()
        key = join_key(self.key, path)
        buf = bytearray(end - start)
        step = self.storage.part_size
        digest = self._digest(path)
        if digest is not None:
            step = max(BLOCK_SIZE, step - step % BLOCK_SIZE)
        subs = [ex.submit(self._fetch_into, key, buf, start, a, min(end, a + step), digest)
                for a in range(start, end, step)]
        out: CFuture[memoryview] = CFuture()
        remaining = [len(subs)]
        lock = threading.Lock()

        def done(f: CFuture[None]) -> None:
            with lock:
                if out.done():
                    return
                if f.exception() is not None:
                    out.set_exception(f.exception())  # type: ignore[arg-type]
                    return
                remaining[0] -= 1
                if remaining[0] == 0:
                    out.set_result(memoryview(buf))

        if not subs:
            out.set_result(memoryview(buf))
        for s in subs:
            s.add_done_callback(done)
        return out

    def _fetch_into(self, key: str, buf: bytearray, base: int, a: int, b: int, digest: FileDigest | None) -> None:
        data = self.storage.read_range(key, a, b)
        if len(data) != b - a:
            if digest is not None:
                raise DamagedCheckpoint(f"{self.storage.uri}/{key}", f"short read: {len(data)} of {b - a} bytes "
                                        f"at offset {a} (commit record says {digest.size} bytes)")
            raise EOFError(f"{self.storage.uri}/{key}: short read {len(data)} of {b - a} bytes at {a}")
        if digest is not None:
            verify_span(f"{self.storage.uri}/{key}", digest, a, data)
        memoryview(buf)[a - base:b - base] = data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        groups = self._groups(plan)
        pending: list[tuple[CFuture[memoryview], tuple[str, int, int, list[ReadItem]]]] = []
        in_flight = 0
        i = 0
        while i < len(groups) or pending:
            while i < len(groups) and (not pending or in_flight + (groups[i][2] - groups[i][1]) <= self.window_bytes):
                g = groups[i]
                pending.append((self._fetch(g[0], g[1], g[2]), g))
                in_flight += g[2] - g[1]
                i += 1
            fut, (path, start, end, reqs) = pending.pop(0)
            view = self.storage.wait(fut, f"read of {self.key}/{path}")
            in_flight -= end - start
            load_items(planner, self.storage_data, view, start, reqs, f"{self.checkpoint_id}/{path}")
        fut2: Future[None] = Future()
        fut2.set_result(None)
        return fut2
