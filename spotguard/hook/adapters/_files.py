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
from ...storage.commit import COMMIT_NAME

__all__ = ["cache_root", "upload_dir", "download_dir", "staging_dir"]


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


def _complete(dest: pathlib.Path, expect: dict[str, int]) -> bool:
    for rel, size in expect.items():
        p = dest / rel
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def download_dir(storage: Storage, key: str, dest_root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """A local copy of storage folder ``key`` (a committed checkpoint); reused when already complete.

    Safe when several ranks of one node call it at once: each downloads into
    its own temporary folder and renames it into place; the loser of the race
    uses the winner's copy.
    """
    digest = hashlib.sha256(storage.uri.encode()).hexdigest()[:12]
    root = pathlib.Path(dest_root) if dest_root is not None else cache_root() / digest
    dest = root / key.strip("/")
    prefix = key.strip("/") + "/"
    expect = {o.key[len(prefix):]: o.size for o in storage.list(prefix)}
    if not expect:
        raise FileNotFoundError(f"{storage.uri}/{key} holds no files")
    if dest.is_dir() and _complete(dest, expect):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        download = getattr(storage, "download", None)
        if callable(download):
            download(key, tmp)
        else:
            for rel in expect:
                p = tmp / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(storage.read_bytes(join_key(key, rel)))
        if dest.exists() and not _complete(dest, expect):
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:  # another rank of this node won the race
            if not _complete(dest, expect):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
