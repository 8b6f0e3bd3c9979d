"""Local/NFS folder backend.

Why temp file + fsync + rename + fsync(dir): a reader (another rank, a resumed
job, ``spotguard checkpoints``) must see either no object or the whole object,
and a power cut right after ``write_bytes`` returns must not lose it. The
directory fsync is what makes the rename itself durable (also on NFS, where
fsync of the directory forces the COMMIT of the namespace change).
"""

from __future__ import annotations

import errno
import os
import stat
import pathlib
import shutil
import sys
import uuid
from typing import TYPE_CHECKING, Mapping

from .base import ObjectInfo, Storage, StorageError, check_key, check_prefix
from .integrity import FileDigest, digest_of

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

__all__ = ["LocalStorage", "TMP_MARK"]

# Temp files of in-flight write_bytes calls carry this mark and are never listed.
TMP_MARK = ".spotguard-tmp-"


def _fsync_dir(path: pathlib.Path) -> None:
    """fsync a directory so that entries created/renamed in it survive a crash."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _fsync_file(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """A checkpoint store in a local or NFS-mounted folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = pathlib.Path(os.path.expanduser(os.fspath(root)))
        self.root: pathlib.Path = pathlib.Path(os.path.abspath(path))
        self.uri = self.root.as_uri()
        if self.root.exists() and not self.root.is_dir():
            raise StorageError(f"storage root {self.root} exists and is not a directory")

    # -- helpers ---------------------------------------------------------------

    def _path(self, key: str) -> pathlib.Path:
        check_key(key)
        return self.root.joinpath(*key.split("/"))

    def _mkdirs(self, path: pathlib.Path) -> None:
        """Create ``path`` and missing parents, fsyncing each parent whose entry we add."""
        missing: list[pathlib.Path] = []
        p = path
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                pass
            _fsync_dir(d.parent)

    # -- Storage API -----------------------------------------------------------

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._mkdirs(path.parent)
        tmp = path.parent / f"{TMP_MARK}{path.name}.{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.write_log.note(key, digest_of(data))
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        _fsync_dir(path.parent)

    def read_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri}/{key} does not exist") from None
        if not stat.S_ISREG(st.st_mode):  # a folder, FIFO, device or symlink: never read (a FIFO blocks forever)
            raise FileNotFoundError(f"{self.uri}/{key} is not a regular file (a folder, link, FIFO or device)")
        return path.read_bytes()

    def read_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        # Walk only the deepest folder the prefix names, then filter by string prefix.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return []
        out: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
            # only folders that can hold a match: list("step-") never reads history/ (thousands of entries)
            dirnames[:] = sorted(d for d in dirnames if _may_hold(f"{rel_dir}/{d}/" if rel_dir else f"{d}/", prefix))
            for name in filenames:
                if name.startswith(TMP_MARK):
                    continue
                key = f"{rel_dir}/{name}" if rel_dir else name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while we walked
                    continue
                if not stat.S_ISREG(st.st_mode):  # a FIFO, device or symlink is no object (reading could hang)
                    continue
                out.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    def delete_prefix(self, prefix: str) -> None:
        check_prefix(prefix)
        if not prefix:
            raise StorageError("refusing to delete the whole storage root (empty prefix)")
        if prefix.endswith("/"):
            target = self.root.joinpath(*prefix[:-1].split("/"))
            if target.is_dir():
                _rmtree(target)
                _fsync_dir(target.parent)
            return
        # A string prefix: delete matching files, then folders left empty.
        for info in self.list(prefix):
            try:
                (self.root / info.key).unlink()
            except FileNotFoundError:
                pass
        head, _, tail = prefix.rpartition("/")
        parent = self.root.joinpath(*head.split("/")) if head else self.root
        if parent.is_dir():
            for child in parent.iterdir():
                if child.name.startswith(tail) and child.is_dir():
                    _rmtree(child)
            _fsync_dir(parent)

    def dcp_writer(self, key: str, *, thread_count: int | None = None) -> "StorageWriter":
        path = self._path(key)
        from .local_dcp import ChecksumWriter

        self._mkdirs(path)
        # sync_files=True: each shard is fsynced before dcp.save returns; one file
        # per rank per thread keeps the file count (and NFS metadata load) small.
        return ChecksumWriter(
            self, key,
            single_file_per_rank=True,
            sync_files=True,
            thread_count=max(1, thread_count or 1),
            overwrite=True,
        )

    def dcp_reader(self, key: str, digests: "Mapping[str, FileDigest] | None" = None) -> "StorageReader":
        path = self._path(key)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint folder {path}")
        from .local_dcp import VerifyingReader

        return VerifyingReader(self, key, digests)

    def local_path(self, key: str) -> pathlib.Path | None:
        return self.root if key in ("", "/") else self._path(key.rstrip("/"))

    def make_durable(self, key: str) -> None:
        path = self._path(key.rstrip("/"))
        if path.is_file():
            _fsync_file(path)
            _fsync_dir(path.parent)
            return
        if not path.is_dir():
            raise FileNotFoundError(f"nothing to make durable at {path}")
        for dirpath, _dirnames, filenames in os.walk(path):
            for name in filenames:
                if not name.startswith(TMP_MARK):
                    try:
                        _fsync_file(pathlib.Path(dirpath, name))
                    except FileNotFoundError:
                        pass
            _fsync_dir(pathlib.Path(dirpath))
        _fsync_dir(path.parent)


def _may_hold(folder: str, prefix: str) -> bool:
    """Whether keys under ``folder`` (ending in "/") can start with ``prefix``."""
    return folder.startswith(prefix) or prefix.startswith(folder)


def _rmtree(path: pathlib.Path) -> None:
    """rmtree that tolerates files vanishing under it (another rank cleaning the same folder)."""

    def on_error(func: object, p: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=on_error)
    else:
        shutil.rmtree(path, onerror=lambda f, p, ei: on_error(f, p, ei[1]))
