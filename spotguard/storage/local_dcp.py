"""DCP writer/reader for local/NFS folders that checksum what they write and verify what they read.

The writer is the stock ``FileSystemWriter`` (its byte format and fsync rules)
whose file streams feed a ``Checksummer`` as the bytes go out; what each rank
wrote lands in the store's ``WriteLog`` for the commit record. The reader
checks every block of each file the load plan touches against the commit
record before DCP's stock reader deserialises any of it, and unpickles
``.metadata`` with the restricted loader. On a local disk the stock reader's
read then comes from the page cache; object stores verify in the one read
(``dcp_object.py``).
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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

from .base import StorageError, check_key, join_key
from .integrity import Checksummer, DamagedCheckpoint, FileDigest
from .safeload import load_dcp_metadata
from .verify import read_verified

if TYPE_CHECKING:
    from .local import LocalStorage

__all__ = ["ChecksumWriter", "VerifyingReader"]

METADATA = ".metadata"


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
    """``FileSystemReader`` that verifies against the commit record and never runs a pickle's code."""

    def __init__(self, storage: "LocalStorage", key: str, digests: Mapping[str, FileDigest] | None) -> None:
        super().__init__(str(storage.local_path(key)))
        self._storage, self._key = storage, key.strip("/")
        self.digests = None if digests is None else dict(digests)
        self._verified: set[str] = set()

    def _check(self, name: str) -> None:
        where = f"{self._storage.uri}/{self._key}/{name}"
        try:
            check_key(name)
        except StorageError as exc:
            raise DamagedCheckpoint(where, f"unsafe file name in the metadata: {exc}") from None
        if self.digests is None or name in self._verified:
            return
        digest = self.digests.get(name)
        if digest is None:
            raise DamagedCheckpoint(where, "read by the metadata but not named in the commit record")
        span = 4 * 1024 * 1024 * 4
        for a in range(0, max(1, digest.size), span):
            read_verified(self._storage, join_key(self._key, name), digest, a, min(digest.size, a + span))
        self._verified.add(name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = f"{self._storage.uri}/{self._key}/{METADATA}"
        try:
            raw = (pathlib.Path(self.path) / METADATA).read_bytes()
        except FileNotFoundError:
            raise DamagedCheckpoint(where, "file is missing") from None
        if self.digests is not None:
            self._check(METADATA)
        md = load_dcp_metadata(raw, where)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        for name in sorted({self.storage_data[r.storage_index].relative_path for r in plan.items}):
            self._check(name)
        return super().read_data(plan, planner)
