"""DCP writer/reader for local/NFS folders that checksum what they write and verify what they read.

The writer is the stock ``FileSystemWriter`` (its byte format and fsync rules)
whose file streams feed a ``Checksummer`` as the bytes go out; what each rank
wrote lands in the store's ``WriteLog`` for the commit record. Tensors are not
copied on the host to be written (issue 22: a save's extra memory must not
grow with the largest tensor). The stock writer ``clone()``s a view of a bigger
storage and ``.cpu()``s a device tensor, whole; here the planner hands it a CPU
view as an alias of its own bytes (``staging.minimal_storage``) and a device
tensor as an untouched placeholder whose bytes the file stream swaps for the
device's, chunk by chunk through the staging pool (as the object-store writer
does, ``dcp_object._StagedTensor``; torch.save's own CRC32 is then off, the
commit record's CRC32C covers every byte). torch.save writes each storage from
its own memory in one ``write``, which the stream hands to the checksum and
the file as it is. Still copied: a strided view (cloned), and a device tensor
under ``SPOTGUARD_STAGING=off`` or below the pool's 1 MiB threshold.

The reader reads each file the load plan touches once, in block-aligned spans,
checks every block against the commit record and deserialises the items from
the same bytes (as the object-store reader does, ``dcp_object.py``); it
unpickles ``.metadata`` with the restricted loader.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import threading
from typing import TYPE_CHECKING, Any, Generator, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

from torch.futures import Future

from .base import join_key
from .dcp_items import METADATA, load_items, parse_metadata, read_groups, recorded_digest
from .integrity import Checksummer, DamagedCheckpoint, FileDigest
from .staging import minimal_storage, staging_mode
from .verify import read_verified

if TYPE_CHECKING:
    from .local import LocalStorage

__all__ = ["ChecksumWriter", "VerifyingReader"]


class _SummingStream:
    """A file stream whose ``write`` also feeds a ``Checksummer``; everything else is the file's.

    A write of a staged placeholder's memory (``_SummingFS.stage``) writes, and sums, the device's
    bytes instead, a pool chunk at a time.
    """

    def __init__(self, raw: Any, summer: Checksummer, fs: "_SummingFS") -> None:
        self._raw, self._sum, self._fs = raw, summer, fs

    def write(self, b: Any) -> int:
        if self._fs.staged:
            mv = memoryview(b).cast("B")
            for source in self._fs.staged_sources():
                chunks = source.chunks_for(mv)
                if chunks is not None:
                    for chunk in chunks:
                        self._sum.update(chunk)
                        self._raw.write(chunk)
                    self._fs.unstage_if_filled(source)
                    return len(mv)
        self._sum.update(b)
        return self._raw.write(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _SummingFS(FileSystem):
    """The stock local file system, remembering each written file's digest (renames follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[pathlib.Path, FileDigest] = {}
        self._lock = threading.Lock()
        # placeholders being written in place of device tensors (each kept alive, so no other
        # placeholder can take its address, until every byte of it went through a stream)
        self.staged: dict[int, tuple[Any, str]] = {}
        self.skip_crc = False  # torch.save would checksum a placeholder's unwritten memory

    def stage(self, source: Any, name: str) -> None:
        with self._lock:
            self.staged[id(source)] = (source, name)

    def staged_sources(self) -> list[Any]:
        with self._lock:
            return [s for s, _ in self.staged.values()]

    def unstage_if_filled(self, source: Any) -> None:
        if source.filled == source.nbytes:
            with self._lock:
                self.staged.pop(id(source), None)

    def check_staged(self) -> None:
        """Fail the save if torch.save left any placeholder byte unwritten through a stream."""
        with self._lock:
            left, self.staged = list(self.staged.values()), {}
        for source, name in left:
            source.check(name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        from .dcp_object import _no_crc32

        summer = Checksummer()
        # torch.save's CRC32 setting is thread-local: off in each writer thread while staging
        with _no_crc32() if self.skip_crc else contextlib.nullcontext(False), \
                super().create_stream(path, mode) as raw:
            yield _SummingStream(raw, summer, self)  # type: ignore[misc]
        with self._lock:
            self.digests[pathlib.Path(path)] = summer.digest()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            d = self.digests.pop(pathlib.Path(path), None)
            if d is not None:
                self.digests[pathlib.Path(new_path)] = d


class _NoCopyPlanner:
    """The save planner, resolving each tensor item to what the file can take without a host copy:
    a CPU view as an alias of its bytes, a device tensor (with ``stage``) as a staged placeholder."""

    def __init__(self, inner: SavePlanner, fs: _SummingFS, *, stage: bool) -> None:
        self._inner, self._fs, self._stage = inner, fs, stage

    def resolve_data(self, item: Any) -> Any:
        data = self._inner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            return data
        if self._stage:
            from .dcp_object import _StagedTensor

            staged = _StagedTensor.of(data)
            if staged is not None:
                self._fs.stage(staged, item.index.fqn)
                return staged.placeholder
        return minimal_storage(data) if data.device.type == "cpu" else data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that reports each file it wrote (size, checksum) to the store's write log."""

    def __init__(self, storage: "LocalStorage", key: str, **kwargs: Any) -> None:
        super().__init__(str(storage.local_path(key)), **kwargs)
        self.fs = _SummingFS()
        self._storage, self._key = storage, key.strip("/")

    def _report(self) -> None:
        fs: _SummingFS = self.fs  # type: ignore[assignment]
        root = pathlib.Path(self.path)
        with fs._lock:
            done, fs.digests = fs.digests, {}
        for path, digest in done.items():
            self._storage.write_log.note(join_key(self._key, path.relative_to(root).as_posix()), digest)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        from .dcp_object import _crc32_skippable

        fs: _SummingFS = self.fs  # type: ignore[assignment]
        mode = staging_mode()
        # Device tensors are staged only where torch.save's CRC32 can be turned off (it would
        # checksum the placeholder): the commit record's CRC32C blocks cover every byte, as for
        # the object-store writer. Without staging (a CPU-only host) the files keep torch's CRC32.
        stage = (mode == "all" or (mode == "auto" and torch.cuda.is_available())) and _crc32_skippable()
        if stage and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pool's copy stream must see the state the step left
        fs.skip_crc = stage
        try:
            fut = super().write_data(plan, _NoCopyPlanner(planner, fs, stage=stage))
            fut.wait()
            fs.check_staged()
        finally:
            fs.skip_crc, fs.staged = False, {}
        self._report()
        return fut

    def finish(self, metadata: Metadata, results: Any) -> None:
        super().finish(metadata, results)
        self._report()


class VerifyingReader(FileSystemReader):
    """``FileSystemReader`` that verifies against the commit record and never runs a pickle's code.

    With the record's checksums, each file the load plan touches is read once,
    in block-aligned spans of at most ``SPAN`` bytes (``verify.read_verified``):
    every block of a span is checked, then the items inside it are
    deserialised from that same buffer. Without them (a record from an older
    spotguard) the stock reader reads the files, with the safe planner.
    """

    SPAN = 64 * 1024 * 1024  # bytes in hand at once (plus the items loaded from them)

    def __init__(self, storage: "LocalStorage", key: str, digests: Mapping[str, FileDigest] | None) -> None:
        super().__init__(str(storage.local_path(key)))
        self._storage, self._key = storage, key.strip("/")
        self.digests = None if digests is None else dict(digests)
        self.bytes_read = 0  # file bytes this reader read (metadata included): each once

    @property
    def _where(self) -> str:
        return f"{self._storage.uri}/{self._key}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            raw = (pathlib.Path(self.path) / METADATA).read_bytes()
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{self._where}/{METADATA}", "file is missing") from None
        self.bytes_read += len(raw)
        return parse_metadata(raw, self.digests, self._where, self.load_id)  # the bytes in hand: no second read

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        digests = self.digests
        if digests is None:
            for name in {self.storage_data[r.storage_index].relative_path for r in plan.items}:
                recorded_digest(None, name, self._where)  # unsafe names are refused even unverified
            return super().read_data(plan, planner)
        groups = read_groups(plan, self.storage_data, lambda n: recorded_digest(digests, n, self._where),
                             self.SPAN, self._where)
        for name, start, end, reqs in groups:
            data = read_verified(self._storage, join_key(self._key, name), digests[name], start, end)
            self.bytes_read += len(data)
            load_items(planner, self.storage_data, memoryview(data), start, reqs, f"{self._where}/{name}")
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
