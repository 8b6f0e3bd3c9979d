"""Moving a framework's checkpoint folder into and out of spotguard storage.

Frameworks (Lightning, Hugging Face, Accelerate) write their own checkpoint
*folder* on the local disk; spotguard storage may be a local/NFS folder or an
object store. Only ``Storage`` methods are used here (``write_bytes``,
``list``, ``read_bytes``; ``download`` when the backend offers parallel ranged
reads), so the same code serves every backend, and the commit protocol in
``storage.commit`` stays the one judge of what is complete.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile
import uuid
from typing import Callable, Optional

from ...storage import Storage
from ...storage.base import join_key
from ...storage.commit import COMMIT_NAME, CheckpointInfo, checkpoint_info
from ...storage.integrity import Checksummer
from ...storage.verify import download_checkpoint

__all__ = ["cache_root", "upload_dir", "download_dir", "staging_dir", "report_local"]


def cache_root() -> pathlib.Path:
    """Where remote checkpoints are downloaded: ``$SPOTGUARD_CACHE``, else ``~/.cache/spotguard``."""
    env = os.environ.get("SPOTGUARD_CACHE")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spotguard"


def staging_dir(tag: str) -> pathlib.Path:
    """A fresh local folder for a framework to write into before the upload (removed by the caller)."""
    root = cache_root() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=root))


def upload_dir(storage: Storage, local: str | os.PathLike[str], key: str,
               select: Optional[Callable[[str], bool]] = None) -> list[str]:
    """Copy the files under ``local`` (recursively) to folder ``key``; returns the relative names written.

    ``select(relative_name)`` picks which files this rank uploads (e.g. rank 0
    the shared files, every rank its own ``rng_state_<rank>.pth``). Each object
    is written whole and atomically (``write_bytes``); the caller commits.
    """
    root = pathlib.Path(local)
    done: list[str] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == COMMIT_NAME or (select is not None and not select(rel)):
            continue
        storage.write_bytes(join_key(key, rel), path.read_bytes())
        done.append(rel)
    return done


def report_local(storage: Storage, key: str, select: Optional[Callable[[str], bool]] = None) -> list[str]:
    """A framework wrote straight into local folder ``key``: put this rank's files (``select``) in the write log.

    The framework's writer cannot checksum as it streams, so each of this rank's
    files is read back once (from the page cache) right after this rank wrote it;
    the commit record then names what the ranks report, as for every other path.
    """
    root = storage.local_path(key)
    done: list[str] = []
    if root is None or not root.is_dir():
        return done
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == COMMIT_NAME or (select is not None and not select(rel)):
            continue
        summer = Checksummer()
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                summer.update(chunk)
        storage.write_log.note(join_key(key, rel), summer.digest())
        done.append(rel)
    return done


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
