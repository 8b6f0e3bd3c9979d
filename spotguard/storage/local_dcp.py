"""DCP writer/reader for local/NFS folders that checksum what they write and verify what they read.

The writer is the stock ``FileSystemWriter`` (its byte format and fsync rules)
whose file streams feed a ``Checksummer`` as the bytes go out; what each rank
wrote lands in the store's ``WriteLog`` for the commit record. The reader
reads each file the load plan touches once, in block-aligned spans, checks
every block against the commit record and deserialises the items from the
same bytes (as the object-store reader does, ``dcp_object.py``); it unpickles
``.metadata`` with the restricted loader.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import threading
from typing import TYPE_CHECKING, Any, Generator, Mapping

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

from torch.futures import Future

from .base import join_key
from .dcp_items import METADATA, load_items, parse_metadata, read_groups, recorded_digest
from .integrity import Checksummer, DamagedCheckpoint, FileDigest
from .verify import read_verified

if TYPE_CHECKING:
    from .local import LocalStorage

__all__ = ["ChecksumWriter", "VerifyingReader"]


class _SummingStream:
    """A file stream whose ``write`` also feeds a ``Checksummer``; everything else is the file's."""

    def __init__(self, raw: Any, summer: Checksummer) -> None:
        self._raw, self._sum = raw, summer

    def write(self, b: Any) -> int:
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

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        summer = Checksummer()
        with super().create_stream(path, mode) as raw:
            yield _SummingStream(raw, summer)  # type: ignore[misc]
        with self._lock:
            self.digests[pathlib.Path(path)] = summer.digest()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            d = self.digests.pop(pathlib.Path(path), None)
            if d is not None:
                self.digests[pathlib.Path(new_path)] = d


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
        fut = super().write_data(plan, planner)
        fut.wait()
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
