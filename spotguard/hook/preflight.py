"""Checks run when the hook is installed, so a user's mistake is one clear error *then*, not at the emergency.

- ``check_launcher``: under torchrun/SLURM-style launchers (``WORLD_SIZE`` > 1 in
  the environment) the hook must be installed after
  ``torch.distributed.init_process_group``; before it, every process would
  believe it is rank 0 of 1 and all of them would write the same checkpoint.
- ``probe_writable``: a small object is written to the storage and deleted
  again, so a read-only path, a missing bucket or missing credentials are
  found at install time instead of as ``checkpoint_failed`` during a notice.
"""

from __future__ import annotations

import os
import socket as _socket
import uuid
from typing import Optional

from ..storage import Storage

__all__ = ["check_launcher", "probe_writable", "PROBE_PREFIX"]

PROBE_PREFIX = ".spotguard-probe-"


def check_launcher(dist_initialized: bool) -> None:
    """Refuse a plain-PyTorch hook under a multi-process launcher before the process group exists."""
    if dist_initialized:
        return
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        world = int(raw) if raw else 1
    except ValueError:
        return  # not a launcher's value: nothing to conclude from it
    if world > 1:
        rank = os.environ.get("RANK", "?")
        raise RuntimeError(
            f"spotguard: WORLD_SIZE={world} (RANK={rank}) says this process is one of {world} launched ranks, "
            "but torch.distributed is not initialised: call torch.distributed.init_process_group() before "
            "install_preemption_hook() (otherwise every rank believes it is rank 0 of 1 and all write the "
            "same checkpoint)"
        )


def probe_writable(storage: Storage) -> Optional[str]:
    """Write and delete a small object under the storage root; None if that worked, else why not."""
    key = f"{PROBE_PREFIX}{_socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        storage.write_bytes(key, b"spotguard write probe\n")
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"cannot write {storage.uri}/{key}: {type(exc).__name__}: {exc}"
    try:
        storage.delete_prefix(key)
    except Exception as exc:  # noqa: BLE001
        return f"wrote {storage.uri}/{key} but cannot delete it: {type(exc).__name__}: {exc}"
    return None


def unwritable_message(uri: str, errors: list[tuple[int, str]]) -> str:
    """One line naming the ranks, the cause and the fix."""
    ranks = ", ".join(str(r) for r, _ in errors)
    return (f"spotguard: checkpoint storage {uri} is not writable from rank(s) {ranks} ({errors[0][1]}): "
            "fix the path's permissions, the bucket name or the credentials, or pass another storage= / "
            "SPOTGUARD_STORAGE; found at install so that no emergency checkpoint is lost to it")
