"""Moving a framework's checkpoint folder into and out of spotguard storage.

Frameworks (Lightning, Hugging Face, Accelerate) write their own checkpoint
*folder* on the local disk; spotguard storage may be a local/NFS folder or an
object store. Only ``Storage`` methods are used here (``write_bytes``,
``list``, ``read_bytes``; ``download`` when the backend offers parallel ranged
reads), so the same code serves every backend, and the commit protocol in
``storage.commit`` stays the one judge of what is complete.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Callable, Mapping, Optional

from ...storage import Storage
from ...storage.base import join_key
from ...storage.commit import COMMIT_NAME
from ...storage.integrity import Checksummer, FileDigest
from ...storage.verify import cache_root, download_dir  # noqa: F401 - moved down to storage (no import circle)

__all__ = ["cache_root", "upload_dir", "download_dir", "staging_dir", "report_local"]


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


def report_local(storage: Storage, key: str, select: Optional[Callable[[str], bool]] = None,
                 known: Optional[Mapping[str, FileDigest]] = None) -> list[str]:
    """A framework wrote straight into local folder ``key``: put this rank's files (``select``) in the write log.

    The framework's writer cannot checksum as it streams, so each of this rank's
    files is read back once (from the page cache) right after this rank wrote it,
    unless ``known`` (absolute path -> digest) has it already;
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
        digest = (known or {}).get(str(path))
        storage.write_log.note(join_key(key, rel), digest if digest is not None else file_digest(path))
        done.append(rel)
    return done


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """The digest of a file, read once in 16 MiB chunks (the read and the CRC release the GIL)."""
    summer = Checksummer()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            summer.update(chunk)
    return summer.digest()
