"""Reading a committed checkpoint's files with every block checked against its commit record.

Used where whole files are read: ``spotguard checkpoints --verify`` and the
download of a committed folder for a framework's resume (``hook.latest()``).
DCP loads check the blocks they fetch in their readers (``dcp_object.py``,
``local.py``). Only files the record names are ever read; each name is
validated before a local path is built from it, the path must stay under the
destination, and each file is written under a temporary name and renamed
once all its blocks checked out.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import uuid
from concurrent.futures import Future
from typing import Any, Callable

from .base import Storage, StorageError, check_key, join_key
from .commit import COMMIT_NAME, CheckpointInfo, CommitRecord, checkpoint_info
from .integrity import BLOCK_SIZE, DamagedCheckpoint, FileDigest, verify_span

__all__ = ["read_verified", "verify_checkpoint", "download_checkpoint", "safe_local_path", "verifiable",
           "latest_verified", "verified_folder", "cache_root", "download_dir"]

SPAN = 4 * BLOCK_SIZE  # bytes per ranged read


def safe_local_path(dest: str | os.PathLike[str], name: str) -> pathlib.Path:
    """``dest/name`` for a key relative to a checkpoint folder, refused if it could leave ``dest``."""
    try:
        check_key(name)
    except StorageError as exc:
        raise DamagedCheckpoint(f"{os.fspath(dest)}", f"unsafe object name {name!r}: {exc}") from None
    root = pathlib.Path(os.path.abspath(dest))
    path = pathlib.Path(os.path.abspath(root.joinpath(*name.split("/"))))
    if path == root or root not in path.parents:
        raise DamagedCheckpoint(str(root), f"object name {name!r} resolves outside the destination")
    return path


def _spans(size: int) -> list[tuple[int, int]]:
    return [(a, min(size, a + SPAN)) for a in range(0, size, SPAN)] or [(0, 0)]


def read_verified(storage: Storage, key: str, digest: FileDigest | None, start: int, end: int) -> bytes:
    """Bytes [start, end) of ``key`` (block-aligned start), checked block by block; ``DamagedCheckpoint`` if not."""
    where = f"{storage.uri}/{key}"
    try:
        data = storage.read_range(key, start, end) if end > start else b""
    except FileNotFoundError:
        raise DamagedCheckpoint(where, "file is missing") from None
    if len(data) != end - start:
        raise DamagedCheckpoint(where, f"short read: {len(data)} of {end - start} bytes at offset {start}")
    if digest is not None:
        verify_span(where, digest, start, data)
    return data


def _each_span(storage: Storage, key: str, digest: FileDigest | None, use: Callable[[int, bytes], None],
               size: int | None = None) -> None:
    """Read every span of one file (in parallel where the store has I/O threads), check it, hand it to ``use``."""
    spans = _spans(digest.size if digest is not None else int(size or 0))
    executor = getattr(storage, "executor", None)
    if executor is None or len(spans) == 1:
        for a, b in spans:
            use(a, read_verified(storage, key, digest, a, b))
        return
    ex = executor()
    futures: list[Future[Any]] = [ex.submit(lambda a=a, b=b: use(a, read_verified(storage, key, digest, a, b)))
                                  for a, b in spans]
    try:
        for f in futures:
            storage.wait(f, f"read of {key}")  # type: ignore[attr-defined]
    finally:
        for f in futures:
            f.cancel()


def _record_files(info: CheckpointInfo) -> tuple[CommitRecord, dict[str, FileDigest]]:
    if not info.committed or info.record is None:
        raise StorageError(f"{info.dir} is not committed: {info.problem}")
    rec = info.record
    if not rec.checksums:
        raise DamagedCheckpoint(info.dir, f"commit record format {rec.format} has no checksums: cannot verify")
    return rec, rec.checksums


def verifiable(info: CheckpointInfo) -> bool:
    """Whether the record carries checksums (format 2); older records vouch for sizes only."""
    return bool(info.record is not None and info.record.checksums)


def verify_checkpoint(storage: Storage, info: CheckpointInfo) -> None:
    """Read every file the record names and check each block; raise ``DamagedCheckpoint`` at the first mismatch."""
    _rec, digests = _record_files(info)
    for name, digest in sorted(digests.items()):
        _each_span(storage, join_key(info.dir, name), digest, lambda a, data: None)


def download_checkpoint(storage: Storage, info: CheckpointInfo, dest: str | os.PathLike[str]) -> pathlib.Path:
    """Copy the files ``info``'s record names into ``dest`` (created), each verified; returns ``dest``.

    Objects in the folder that the record does not name are not downloaded.
    A file is written as ``<name>.<random>.part`` and renamed only once every
    block checked out; on error nothing half-written keeps a real name.
    """
    if verifiable(info):
        rec, digests = _record_files(info)
        files: dict[str, FileDigest | None] = dict(digests)
    else:  # an older record: names and sizes only
        if not info.committed or info.record is None:
            raise StorageError(f"{info.dir} is not committed: {info.problem}")
        rec, files = info.record, {n: None for n in info.record.files}
    root = pathlib.Path(os.path.abspath(dest))
    root.mkdir(parents=True, exist_ok=True)
    for name, digest in sorted(files.items()):
        size = rec.files[name]
        path = safe_local_path(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                os.ftruncate(fd, size)

                def use(a: int, data: bytes, fd: int = fd) -> None:
                    os.pwrite(fd, data, a)

                _each_span(storage, join_key(info.dir, name), digest, use, size)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
    if rec.files and COMMIT_NAME not in files:
        (root / COMMIT_NAME).write_bytes(rec.to_json().encode("utf-8"))
    return root


def latest_verified(storage: Storage, log: Any) -> tuple[CheckpointInfo, pathlib.Path] | None:
    """The newest committed checkpoint that verifies, as a local folder (downloaded from an object store).

    A damaged one is skipped with one log line naming the file and what differed,
    quarantined (``quarantine.py``), and the previous one is tried; None when
    nothing is committed; a ``RuntimeError`` when checkpoints are committed but
    none verifies (quarantined ones included).
    """
    from .commit import newest_committed, quarantine, scan  # noqa: PLC0415

    below: int | None = None
    damaged: list[str] = []
    while True:
        info = newest_committed(storage, below=below)
        if info is None:
            damaged += [i.dir for i in scan(storage) if i.quarantine is not None and i.dir not in damaged]
            if damaged:  # starting from 0 over quarantined work is the operator's call
                raise RuntimeError(f"spotguard: no committed checkpoint in {storage.uri} passed verification "
                                   f"(damaged: {', '.join(damaged)}); restore them from a backup, or delete "
                                   f"them to start from step 0")
            return None
        try:
            return info, verified_folder(storage, info, log)
        except DamagedCheckpoint as exc:
            log.error("skipping damaged checkpoint", dir=info.dir, step=info.step, file=exc.where, problem=exc.what)
            damaged.append(info.dir)
            quarantine(storage, info, exc.what, exc.where, "latest")  # the next restart does not read it again
            below = info.step


def verified_folder(storage: Storage, checkpoint: CheckpointInfo | str, log: Any = None) -> pathlib.Path:
    """A local folder holding ``checkpoint``, every file checked: the store's own folder (verified in
    place) or a verified download; raises ``DamagedCheckpoint``."""
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else checkpoint_info(storage, checkpoint)
    if not info.committed:
        raise DamagedCheckpoint(f"{storage.uri}/{info.dir}", f"not committed: {info.problem}")
    if not verifiable(info) and log is not None:
        log.warning("commit record has no checksums (older spotguard): using it unverified", dir=info.dir)
    path = storage.local_path(info.dir)
    if path is None:
        return download_dir(storage, info)
    if verifiable(info):
        verify_checkpoint(storage, info)
    return path


# --- a cached, verified local copy (framework adapters, ``verified_folder``) ---------------


def cache_root() -> pathlib.Path:
    """Where remote checkpoints are downloaded: ``$SPOTGUARD_CACHE``, else ``~/.cache/spotguard``."""
    env = os.environ.get("SPOTGUARD_CACHE")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spotguard"


def _cached(dest: pathlib.Path, record: bytes, sizes: dict[str, int]) -> bool:
    """A copy this code downloaded (and verified) earlier for exactly this commit record."""
    try:
        if (dest / COMMIT_NAME).read_bytes() != record:
            return False
    except OSError:
        return False
    return all((dest / rel).is_file() and (dest / rel).stat().st_size == n for rel, n in sizes.items())


def download_dir(storage: Storage, checkpoint: "CheckpointInfo | str",
                 dest_root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """A local copy of a committed checkpoint folder, every file verified; reused when already complete.

    Only the files its commit record names are downloaded, each checked block by
    block against the record (``storage.verify``); a damaged file raises
    ``DamagedCheckpoint``. Safe when several ranks of one node call it at once:
    each downloads into its own temporary folder and renames it into place; the
    loser of the race uses the winner's copy.
    """
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else checkpoint_info(storage, checkpoint)
    if not info.committed or info.record is None:
        raise FileNotFoundError(f"{storage.uri}/{info.dir} is not a committed checkpoint: {info.problem}")
    digest = hashlib.sha256(storage.uri.encode()).hexdigest()[:12]
    root = pathlib.Path(dest_root) if dest_root is not None else cache_root() / digest
    dest = root / info.dir
    record = info.record.to_json().encode("utf-8")
    if dest.is_dir() and _cached(dest, record, info.record.files):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        download_checkpoint(storage, info, tmp)
        (tmp / COMMIT_NAME).write_bytes(record)
        if dest.exists() and not _cached(dest, record, info.record.files):
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:  # another rank of this node won the race
            if not _cached(dest, record, info.record.files):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
