"""The other groups of a whole-job leave: wait for the writer group's commit, write it themselves if it fails.

Why: when every replica group is noticed at one step, the group of replica rank 0
writes the emergency checkpoint (the state is replicated: one copy is enough). The
other groups used to exit at once, so a writer whose save failed (a full disk, a lost
bucket, its VM gone early) lost everything since the last periodic checkpoint although
the other groups held the same state. Now they wait for the commit of that step in the
shared storage: rank 1 until ``deadline - fallback_lead`` (then it writes the step
itself: the failover), higher ranks until just before their deadline (then exit 75,
never "nothing lost"). No channel but the storage: torchft's process group is shut
down by then and the writer may be gone.

A failover cannot tell a failed writer from a slow one still uploading; both write
the same step folder, and a slow writer that commits while the failover writes makes
the failover's own commit fail (a checkpoint of another run's lineage). Hence the
failover starts only at ``deadline - lead`` (the same lead as the deadline fallback).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..hook.core import EXIT_SAVE_FAILED, Preempted
from ..notice import Notice
from ..storage.base import join_key
from ..storage.commit import checkpoint_info, step_dir
from ..storage.record import COMMIT_NAME

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ReplicaGuard

__all__ = ["committed_at", "await_commit", "await_writer", "takeover_at", "FAILOVER", "BY_PEER", "UNCONFIRMED"]

FAILOVER = "replica_failover"  # step, waited, why: the writer group's commit did not come: this group writes
BY_PEER = "replica_written_by_peer"  # step, waited: another group committed the step: this one leaves
UNCONFIRMED = "replica_leave_unconfirmed"  # step, waited, why, fix: no commit seen by the deadline (exit 75)

_POLL_FIRST, _POLL_MAX = 0.1, 0.5  # seconds between two looks at the storage (backing off)


def committed_at(storage: Any, step: int) -> bool:
    """``step``'s folder holds a commit record that checks out (a cheap existence check first: the writer's
    folder fills while we look, and the full check lists it)."""
    key = step_dir(step)
    try:
        return bool(storage.exists(join_key(key, COMMIT_NAME)) and checkpoint_info(storage, key).committed)
    except Exception:  # noqa: BLE001 - a storage that fails here may work for the writer; look again
        return False


def await_commit(storage: Any, step: int, until: float, *, group: Any = None, look: bool = True) -> bool:
    """Wait until ``step`` is committed in ``storage`` (True) or ``time.monotonic()`` passes ``until`` (False).

    ``group``: the replica group's own process group when it has several processes: every round is a MAX
    all-reduce of (seen, due), so all its ranks decide alike (one writes only if all write; ``look``: whether
    this rank reads the storage — the group's rank 0 does).
    """
    pause = _POLL_FIRST
    while True:
        seen = look and committed_at(storage, step)
        due = time.monotonic() >= until
        if group is not None:
            import torch.distributed as dist  # noqa: PLC0415

            t = torch.tensor([int(seen), int(due)], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            seen, due = bool(t[0]), bool(t[1])
        if seen:
            return True
        if due:
            return False
        time.sleep(min(pause, max(0.0, until - time.monotonic())))  # a remote store: no event to await
        pause = min(_POLL_MAX, pause * 1.5)


def takeover_at(rank: int, seconds_left: float, lead: float) -> Optional[float]:
    """Monotonic time at which group ``rank`` stops waiting: rank 1 at ``deadline - lead`` (then it writes),
    higher ranks 0.5 s before the deadline (then they exit 75); rank 0 (the writer) never waits."""
    if rank <= 0:
        return None
    now = time.monotonic()
    if rank == 1:
        return now + max(0.0, seconds_left - lead)
    return now + max(0.0, seconds_left - 0.5)


def await_writer(guard: "ReplicaGuard", notice: Notice, step: int, lead: float) -> None:
    """A whole-job leave's non-writer, at its next training forward: leave (``Preempted``, committed) once the
    writer group's commit of ``step`` is in storage; without it by the takeover time, rank 1 returns (it writes
    the step itself: the failover), higher ranks exit 75."""
    rank, hook = guard._replica_rank, guard.hook
    until = takeover_at(rank, notice.seconds_left(), lead)
    assert until is not None
    t0 = time.monotonic()
    seen = await_commit(hook._storage, step, until, group=hook._group, look=hook._rank == 0)
    waited = round(time.monotonic() - t0, 3)
    if seen:
        guard._log.info(BY_PEER, notice_id=notice.id, step=step, waited=waited, replica_rank=rank)
        hook._flush_intake()
        hook.close()
        raise Preempted(guard._exit_code, notice_id=notice.id, step=step, committed=True)
    why = ("no commit of this step from the writer group (replica rank 0) by deadline - lead: its save failed, "
           "its VM is gone, or it is still uploading")
    if rank == 1:
        guard._log.warning(FAILOVER, notice_id=notice.id, step=step, waited=waited, why=why,
                           seconds_left=round(notice.seconds_left(), 3))
        return
    guard._log.error(UNCONFIRMED, notice_id=notice.id, step=step, waited=waited, replica_rank=rank,
                     why=why + ", nor from replica rank 1 by the deadline",
                     fix="the newest committed checkpoint stands; periodic checkpoints (every=) bound the loss")
    hook._hard_exit(notice, EXIT_SAVE_FAILED, step, committed=False, nothing=False, by="replica-unconfirmed")
