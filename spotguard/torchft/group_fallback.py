"""The deadline fallback of a replica group of several processes: every rank writes its part, together.

Why a mechanism of its own: in a group of several processes only the ranks on the
noticed node hear the notice, and the group's training threads are where they are
(often blocked inside torchft's quorum: the reason the group cannot leave). One
rank's watchdog cannot write the group's shards alone, and a collective on the
group's own process groups would collide with the training threads' (the user's
data parallelism, the leave flag's MAX). So:

* at install every rank builds a gloo group of its own for this (``new_group``: every
  rank calls it) and starts a listener thread waiting on a key in torchrun's store
  (a client of its own: a blocking ``wait`` on the shared client would hold it);
* a noticed rank's watchdog, at ``deadline - lead``, sets the key (the notice and its
  deadline): every rank's listener wakes;
* each rank holds its optimizer if its training thread is inside an iteration (the
  state is then its last committed step's; the same rule as one process's
  watchdog), and the ranks agree (MAX on the side group) that all are held at the
  same step; then every rank writes its part through the hook's save on the side
  group (DCP on it too), rank 0 commits, all leave;
* a rank still in the post-step work of its last step (its state may move), or steps
  that differ, cancel it: the group ends with the bounded exit 75 at the deadline
  (``replica_fallback_missed``), as before.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Optional

from ..hook.dist import all_max, set_group_timeout
from ..hook.save import _BG
from ..notice import Notice

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ReplicaGuard

__all__ = ["GroupFallback"]

_WAIT = timedelta(seconds=5)  # one store wait; the listener loops until the guard is done


def _store() -> Any:
    """A client of torchrun's store (MASTER_ADDR/PORT), or None outside torchrun."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    from torch.distributed import TCPStore  # noqa: PLC0415

    return TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10))


class GroupFallback:
    """One per rank of a multi-process replica group (built by ``ReplicaGuard``)."""

    def __init__(self, guard: "ReplicaGuard") -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self.guard = guard
        self.group = dist.new_group(backend="gloo")  # collective: every rank builds its guard at the same point
        # a key of this install's own (rank 0's uuid, sent to all): torchrun's store outlives an attempt (the
        # agent shares its rendezvous store), and TORCHELASTIC_RESTART_COUNT is each agent's own count (kept
        # on a membership change): a key named by it could be one a previous attempt set, and would wake a
        # restarted group at once on a stale notice, or differ between the ranks of one group
        name = [uuid.uuid4().hex if dist.get_rank(self.group) == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.key = f"spotguard/replica-fallback/{name[0]}"
        try:
            self.store = _store()
        except Exception as exc:  # noqa: BLE001 - no store: the bounded exit 75 stands (docs/torchft.md, 7)
            guard._log.warning("replica_group_fallback_unavailable", error=f"{type(exc).__name__}: {exc}",
                               why="torchrun's store (MASTER_ADDR/MASTER_PORT) cannot be reached: a deadline "
                                   "fallback of this group ends with 75 instead of a write")
            self.store = None
        self._thread: Optional[threading.Thread] = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._listen, daemon=True, name="spotguard-replica-group-fb")
            self._thread.start()

    @property
    def available(self) -> bool:
        return self.store is not None

    def trigger(self, notice: Notice) -> None:
        """A noticed rank's watchdog at ``deadline - lead``: wake every rank's listener (this one's too)."""
        # a client of its own: the listener's blocking wait holds its client's lock (a set through it waited
        # for that wait's timeout)
        (_store() or self.store).set(self.key, json.dumps({
            "id": notice.id, "source": notice.source, "kind": notice.kind, "deadline": notice.deadline.isoformat(),
            "received_at": notice.received_at.isoformat()}))

    def _listen(self) -> None:
        g = self.guard
        while not g._done.is_set() and not g.hook._life.closed:
            t0 = time.monotonic()
            try:
                self.store.wait([self.key], _WAIT)
            except Exception:  # noqa: BLE001 - the wait's timeout (or the store is gone: look less often)
                if time.monotonic() - t0 < 1.0:
                    g._done.wait(1.0)
                continue
            try:
                raw = json.loads(self.store.get(self.key))
                notice = Notice(id=raw["id"], source=raw["source"], kind=raw["kind"],
                                deadline=datetime.fromisoformat(raw["deadline"]),
                                received_at=datetime.fromisoformat(raw["received_at"]),
                                detail="a noticed rank of this replica group: the group's deadline fallback")
                self.run(notice)
            except Exception as exc:  # noqa: BLE001 - never die silently: the watchdog's bounded 75 still stands
                g._log.error("replica_fallback_missed", why=f"group fallback failed: {type(exc).__name__}: {exc}")
            return

    def _release(self) -> None:
        """Call the hold off: an optimizer step held meanwhile goes on (no single-process hold in such a group)."""
        with self.guard._lock:
            self.guard._fallback_on = False
        self.guard._halt.set()

    def run(self, notice: Notice) -> None:
        """Every rank, on its listener thread: hold, agree, write the last committed step together, leave."""
        g, hook = self.guard, self.guard.hook
        with g._lock:
            ready = g._phase == "iter" and not g._over.is_set() and not hook._life.closing()
            if ready:
                g._fallback_on = True  # from here every optimizer step of this process is held
        step = hook._steps.count
        # bounded by the deadline: a rank whose listener never comes (no store client) must not keep this one
        # held (its training thread waits at the optimizer step) past the deadline
        set_group_timeout(self.group, notice.seconds_left() - 0.5)
        try:
            not_ready, top, neg_low = all_max(self.group, [0 if ready else 1, step, -step])
        except BaseException:
            self._release()  # a peer gone during the agreement: this rank's held steps must not stay held
            raise
        if not_ready or top != -neg_low:
            self._release()
            g._log.warning("replica_group_fallback_cancelled", notice_id=notice.id, step=step, ready=ready,
                           why="a rank of this group is in the post-step work of its last step (its state may "
                               "move) or the ranks' steps differ: the bounded exit at the deadline stands")
            return
        g._over.set()
        g._done.set()
        g._log.warning("replica_fallback", notice_id=notice.id, step=step, where="group",
                       seconds_left=round(notice.seconds_left(), 3),
                       why="this group has not left by deadline - lead: every rank writes its part together")
        hook._internal = True  # the training thread's hook points stand still meanwhile
        if hook._standing(step)[0]:
            hook._exit_from_background(notice, None, step)
            return
        _BG.on = True  # this thread: no DCP fake step() under the training thread
        snap = g._snap_of_last_step()

        def write(key: str) -> None:
            hook._dcp_writer(hook._save_state_dict(snap), self.group, False)(key)

        result = hook._save(notice, "emergency", snap, group=self.group, write=write)
        hook._exit_from_background(notice, result, step)
