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

A failover cannot tell a failed writer from a slow one for sure; both would write
the same step folder, and a save clears what it finds there first (the review
reproduced it: the failover cleared a slow writer's shards, wrote over them, and
neither committed). So the failover starts only at ``deadline - lead`` and only if
the writer's step folder has not changed for ``_QUIET`` seconds (a writer filling it
is alive: the failover then waits for its commit like the higher ranks). Limit: an
object store shows a multipart upload only when it completes, so one large shard
still uploading looks quiet. And each group has a lineage of its own unless it
resumed, so a save that finds the step committed by the other group fails
("another run"): both the writer and the failover look at the storage before and
after their save and leave committed when the step is there (``write_step``).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, Optional

from ..hook.core import EXIT_SAVE_FAILED, Preempted
from ..hook.dist import all_max
from ..hook.save import _Result
from ..notice import Notice
from ..timefmt import parse_rfc3339
from ..storage.base import join_key
from ..storage.commit import checkpoint_info, step_dir
from ..storage.record import COMMIT_NAME

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ReplicaGuard

__all__ = ["committed_at", "await_commit", "await_writer", "write_step", "takeover_at", "FolderWatch", "FAILOVER",
           "DEFERRED", "BY_PEER", "UNCONFIRMED"]

FAILOVER = "replica_failover"  # step, waited, why: the writer group's commit did not come: this group writes
BY_PEER = "replica_written_by_peer"  # step, waited: another group committed the step: this one leaves
UNCONFIRMED = "replica_leave_unconfirmed"  # step, waited, why, fix: no commit seen by the deadline (exit 75)
DEFERRED = "replica_failover_deferred"  # step: the writer's folder still changes at the takeover time: no write

_POLL_FIRST, _POLL_MAX = 0.1, 0.5  # seconds between two looks at the storage (backing off)
_SKEW = timedelta(seconds=30)  # VMs' clocks may differ this much (a commit's created_at against our notice)
_QUIET = 2 * _POLL_MAX  # the writer's folder unchanged this long (two looks at least): it is not writing


class FolderWatch:
    """What ``step``'s folder held at the last look and when that last changed: a writer filling it is alive."""

    def __init__(self, storage: Any, step: int) -> None:
        self.storage, self.prefix = storage, step_dir(step) + "/"
        self.held: tuple[tuple[str, int], ...] = ()
        self.changed = time.monotonic()

    def look(self) -> None:
        try:
            held = tuple(sorted((o.key, o.size) for o in self.storage.list(self.prefix)))
        except Exception:  # noqa: BLE001 - unknown: counts as no change (a storage this one cannot read)
            return
        if held != self.held:
            self.held, self.changed = held, time.monotonic()

    def busy(self) -> bool:
        """The folder holds something that changed within the last ``_QUIET`` seconds."""
        return bool(self.held) and time.monotonic() - self.changed < _QUIET


def _agree(flag: bool, group: Any) -> bool:
    """``flag`` of any rank of the replica group (MAX), so that its ranks decide alike."""
    return bool(all_max(group, [int(flag)])[0])


def committed_at(storage: Any, step: int, since: Optional[datetime] = None, lineage: Optional[str] = None) -> bool:
    """``step``'s folder holds a commit record that checks out (a cheap existence check first: the writer's
    folder fills while we look, and the full check lists it) and, given ``since``, is this leave's: an emergency
    record written after ``since`` (less ``_SKEW`` for the VMs' clocks) or of this run's ``lineage`` (groups that
    resumed share it). Not any commit of the step: another run that used the same storage and reached the same
    step (never resumed from) committed state that is not this job's."""
    key = step_dir(step)
    try:
        if not storage.exists(join_key(key, COMMIT_NAME)):
            return False
        info = checkpoint_info(storage, key)
        if not info.committed or since is None:
            return bool(info.committed)
        rec = info.record
        if rec is None:
            return False
        if lineage is not None and rec.extra.get("lineage") == lineage:
            return True
        return rec.reason == "emergency" and parse_rfc3339(rec.created_at) >= since - _SKEW
    except Exception:  # noqa: BLE001 - a storage that fails here may work for the writer; look again
        return False


def _ours(guard: "ReplicaGuard", notice: Notice) -> dict[str, Any]:
    """``committed_at``'s test of a commit made by this whole-job leave (another group's, or this one's)."""
    return {"since": notice.received_at, "lineage": guard.hook._lineage}


def await_commit(storage: Any, step: int, until: float, *, group: Any = None, look: bool = True,
                 watch: Optional[FolderWatch] = None, ours: Optional[dict[str, Any]] = None) -> bool:
    """Wait until ``step`` is committed in ``storage`` (True) or ``time.monotonic()`` passes ``until`` (False).

    ``group``: the replica group's own process group when it has several processes: every round is a MAX
    all-reduce of (seen, due), so all its ranks decide alike (one writes only if all write; ``look``: whether
    this rank reads the storage — the group's rank 0 does; ``watch``: also follow the step folder's content).
    """
    pause = _POLL_FIRST
    while True:
        seen = look and committed_at(storage, step, **(ours or {}))
        if watch is not None and look and not seen:
            watch.look()
        seen, due = (bool(v) for v in all_max(group, [int(seen), int(time.monotonic() >= until)]))
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
    the step itself: the failover) unless the writer still fills its folder, higher ranks exit 75. The writer
    (rank 0) when it starts after ``deadline - lead``: returns (it writes) unless the failover fills the folder."""
    rank, hook = guard._replica_rank, guard.hook
    # the writer itself comes here only when its write starts after deadline - lead (its loop's post-step work
    # ran long): the failover may be writing; it looks at the folder for _QUIET seconds first
    until = takeover_at(rank, notice.seconds_left(), lead) if rank > 0 else time.monotonic() + _QUIET
    assert until is not None
    look = hook._rank == 0
    watch = FolderWatch(hook._storage, step) if rank <= 1 and look else None
    t0 = time.monotonic()
    seen = await_commit(hook._storage, step, until, group=hook._group, look=look, watch=watch,
                        ours=_ours(guard, notice))
    why = ("no commit of this step from the writer group (replica rank 0) by deadline - lead: its save failed, "
           "its VM is gone, or it is still uploading")
    if not seen and rank <= 1 and _agree(watch is not None and watch.busy(), hook._group):
        other = "writer group's" if rank else "failover's (replica rank 1)"
        guard._log.warning(DEFERRED, notice_id=notice.id, step=step, seconds_left=round(notice.seconds_left(), 3),
                           why=f"the {other} step folder still changes after deadline - lead: it is writing "
                               "(a second save of the same step would clear its files); waiting for its commit")
        why = f"the {other} save was still writing after deadline - lead and did not commit by the deadline"
        seen = await_commit(hook._storage, step, time.monotonic() + max(0.0, notice.seconds_left() - 0.5),
                            group=hook._group, look=look, ours=_ours(guard, notice))
        rank = 2  # no failover any more: a commit, or the bounded 75
    waited = round(time.monotonic() - t0, 3)
    if seen:
        guard._log.info(BY_PEER, notice_id=notice.id, step=step, waited=waited, replica_rank=guard._replica_rank)
        hook._flush_intake()
        hook.close()
        raise Preempted(guard._exit_code, notice_id=notice.id, step=step, committed=True)
    if rank == 0:
        return  # a late writer whose folder is quiet: the failover did not start (or died): it writes
    if rank == 1:
        guard._log.warning(FAILOVER, notice_id=notice.id, step=step, waited=waited, why=why,
                           seconds_left=round(notice.seconds_left(), 3))
        return
    guard._log.error(UNCONFIRMED, notice_id=notice.id, step=step, waited=waited, replica_rank=guard._replica_rank,
                     why=why + ("" if guard._replica_rank == 1 else ", nor from replica rank 1 by the deadline"),
                     fix="the newest committed checkpoint stands; periodic checkpoints (every=) bound the loss")
    hook._hard_exit(notice, EXIT_SAVE_FAILED, step, committed=False, nothing=False, by="replica-unconfirmed")


def _peer_committed(guard: "ReplicaGuard", notice: Notice, step: int, group: Any = None) -> bool:
    hook = guard.hook
    return _agree(hook._rank == 0 and committed_at(hook._storage, step, **_ours(guard, notice)), group)


def write_step(guard: "ReplicaGuard", notice: Notice, step: int, snap: Any) -> NoReturn:
    """A whole-job leave's write of ``step`` (the writer group, or rank 1's failover), then exit.

    The step may be committed by the other group around this save (a slow writer committing at the takeover
    time, a failover done before a late writer's loop came back): its save then fails ("already committed by
    another run": the groups have lineages of their own) although the state is in storage. Looked at before
    and after the save: the group leaves committed (143) instead of claiming a failure (75)."""
    hook = guard.hook
    hook._steps.set_count(step)
    hook._internal = True
    if _peer_committed(guard, notice, step, hook._group):
        result = _Result(committed=True, uri=f"{hook._storage.uri}/{step_dir(step)}")
    else:
        result = hook._save(notice, "emergency", snap)
        # after a failed collective the group cannot agree: only a single process looks on its own
        if not result.committed and (result.peers_ok or hook._group is None) \
                and _peer_committed(guard, notice, step, hook._group):
            result = _Result(committed=True, uri=f"{hook._storage.uri}/{step_dir(step)}", seconds=result.seconds)
        else:
            hook._exit(notice, result)
    guard._log.info(BY_PEER, notice_id=notice.id, step=step, replica_rank=guard._replica_rank,
                    why="another group committed this step around this group's own save")
    hook._exit(notice, result)
