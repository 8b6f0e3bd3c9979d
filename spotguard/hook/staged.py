"""The saves that run beside training: a notice's staged save (agreement thread) and the periodic one's
hook side (``every=``; the upload itself is ``periodic.py``).

Why a module of its own (issue 28, part 2): the staged save is a sequence over the clock (``clock.py``: wait
until this rank ended S, release or keep the hold) and the state at S (``stateat.py``: the tensors, the small
state); ``SaveMixin._save`` (save.py) writes and commits what it hands over. It moves the clock through
``StepClock.wait_reached``/``unhold`` and the hook's ``_release_hold``; the exact fallback
(``_save_next_iteration``) moves the hold to the next iteration (``StepClock.retarget``) and asks for that
step's read (``StateAtS.drop_small``, ``arm_read``), under ``_steps.cv``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from ..notice import Notice
from . import events as ev
from .outcome import _OWN, _Result
from .periodic import PERIODIC_SETTLED, stage_state_dict
from .settings import HANDED_OVER, SAVE_MARGIN
from .state import Snapshot
from .stateat import StateMoved, _with_small

__all__ = ["StagedSaveMixin"]


class _StoreCancel:
    """This rank's cancel flag, or any rank's (the round's cancel key in the c10d store, asked every 20 ms)."""

    def __init__(self, local: threading.Event, bg: Any) -> None:
        self._local, self._bg, self._next = local, bg, 0.0

    def is_set(self) -> bool:
        if self._local.is_set():
            return True
        now = time.monotonic()
        if now >= self._next:
            self._next = now + 0.02
            if self._bg.round_cancelled():
                self._local.set()
                return True
        return False


class StagedSaveMixin:
    """Part of ``Hook`` (through ``SaveMixin``); see the module docstring."""

    def _save_staged(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, *,
                     hold: bool = False) -> _Result:
        """The agreement thread: checkpoint of completed iteration ``step`` while training goes on. Never raises.

        1. wait until this rank's count is ``step`` and its training thread is not
           inside ``optimizer.step``; 2. read model and optimizer tensors in the
           background, but only while ``StateWatch`` proves nothing wrote them since
           step ``step`` (watch.py) — otherwise, or for FSDP2, the exact fallback: the
           training thread reads them at its next ``optimizer.step()`` pre-hook, where
           the loop's post-step work is over; 3. the small state (``_small_state``);
           4. DCP save + commit on ``group``. An emergency (``hold``) writes straight
           from the live tensors (no second copy on the host: the training thread
           stays held at its next step until the exit) and checks the watch again
           before the commit; a failed or invalidated attempt is retried once from
           the fallback read. An ordinary checkpoint copies (``stage_state_dict``),
           checks the watch after the copy, and releases the training thread.
        """
        t0 = time.monotonic()
        reached = self._steps.wait_reached(step, t_end,
                                           lambda: self._life.exit_requested or self._handing_over(step))
        if self._handing_over(step):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if not reached:
            return self._fail(notice, step, f"the training thread did not reach step {step} within the notice "
                              f"deadline (at {self._steps.count}, inside a step: {self._steps.in_step}): peers lost?", t0,
                              peers_ok=False)
        # The small state first: its anchor (the model's next forward, the next step, the end of training) is
        # also where the loop's post-step writes to tensors are over (an AveragedModel update, an EMA swapped
        # back); reading the tensors before it could commit them without those writes.
        small = self._small_state(step, t_end)
        if isinstance(small, str) and self._handing_over(step):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if isinstance(small, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, step, small, t0, peers_ok=True)
        live = hold
        got = self._background_read(step, copy=not live)
        if not self._all_ok(not isinstance(got, str), group):  # every rank takes the same branch
            why = got if isinstance(got, str) else "another rank could not prove its live state is step's"
            return self._save_next_iteration(notice, reason, step, t_end, group, hold=hold, why=why, t0=t0)
        return self._write_staged(notice, reason, step, t_end, group, got, small, hold=hold, live=live, t0=t0)

    def _write_staged(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, got: Any,
                      small: Any, *, hold: bool, live: bool, t0: float, retry: bool = True,
                      keep_step: bool = False) -> _Result:
        """The staged save's second half: the tensors ``got`` and the small state of ``step`` -> DCP save ->
        commit; an emergency written from live tensors that moved meanwhile is retried once, from the end of
        the next iteration."""
        sd, nbytes, where_read = got
        blob, groups, where = small
        copied = time.monotonic() - t0
        self._live_moved = None
        with self._steps.cv:
            self._state_at.hold_staged(step)
            self._steps.unhold(keep_target=hold)
            self._state_at.clear_wants()
            self._steps.cv.notify_all()
        self._log.info(ev.CHECKPOINT_STAGED, notice_id=notice.id, step=step, bytes=nbytes,
                       seconds=round(copied, 4), small_state_from=where, tensors_from=where_read,
                       host_copy=not hold)  # an emergency writes the held live tensors: no second copy
        sd = _with_small(sd, groups, self._rank_key(self._rank), blob)
        cancel = None if hold else self._ordinary_cancel  # an emergency arriving now pre-empts this save
        if cancel is not None:
            bg = self._bg
            if bg is not None:
                cancel = _StoreCancel(cancel, bg)
        result = self._save(notice, reason, None, group=group, step=step,
                            write=self._dcp_writer(sd, group, live, cancel), bound=max(1.0, t_end - time.monotonic()))
        if result.committed or not result.peers_ok or not hold or not retry or time.monotonic() >= t_end - 1.0:
            if not retry and not keep_step:  # the exact fallback's step, not the agreed one
                result.step = step
            return result  # (an ordinary checkpoint is not retried: every rank must take the same branch)
        # Every rank sees the same failed result (``_save``'s all-OK reduction): every rank retries, once. The
        # live state moved on some rank (what was there at ``step`` is gone): from the end of the next iteration.
        # Any other failure (storage, a step folder another run committed): the same step, if still provable —
        # a failure that the next step would only dodge (another run's folder) must not become a commit.
        moved = isinstance(getattr(self, "_live_moved", None), str)
        if not self._all_ok(not moved, group):
            return self._save_next_iteration(notice, reason, step, t_end, group, hold=hold, t0=t0,
                                             why=f"{result.error} (second attempt)")
        got = self._background_read(step, copy=False)
        if not self._all_ok(not isinstance(got, str), group):
            return result
        return self._write_staged(notice, reason, step, t_end, group, got, small, hold=hold, live=True, t0=t0,
                                  retry=False, keep_step=True)

    def _save_next_iteration(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, *,
                             hold: bool, why: str, t0: float) -> _Result:
        """The exact fallback. The live tensors may not be those of ``step`` any more — a write the watch saw
        since that iteration's end: an EMA swapped in, a momentum encoder updated inside the forward, SAM's
        perturbation, ``p.data`` scaled by hand before the step — and what they were is gone (no copy is
        kept). So the checkpoint stands for the next iteration's end instead: the training thread reads the
        state at its first training forward after step ``step + 1`` (held there for an emergency), the one
        point where an iteration's end is known, whatever the loop writes inside its iterations. Every rank
        comes here together (the caller's reduction). Costs up to one iteration."""
        nxt = step + 1
        self._log.info(ev.CHECKPOINT_FALLBACK, notice_id=notice.id, step=step, reason=why,
                       waits_for=f"the end of the next iteration (its first training forward after step {nxt}): "
                                 f"the checkpoint stands for step {nxt}")
        with self._steps.cv:  # armed together: the training thread must find the request at its very next anchor
            self._steps.retarget(nxt)  # the training thread steps once more, then is held (an emergency) or read
            self._state_at.drop_small()
            self._state_at.arm_read(nxt, copy=not hold)
        got = self._prehook_read(nxt, t_end, copy=not hold, armed=True)
        if isinstance(got, str) and self._handing_over(nxt):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if isinstance(got, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, nxt, got, t0, peers_ok=True)
        sd, nbytes, where_read, at = got  # at: nxt, or step when training ended there (its work is over)
        small = self._small_state(at, t_end)
        if isinstance(small, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, at, small, t0, peers_ok=True)
        return self._write_staged(notice, reason, at, t_end, group, (sd, nbytes, where_read), small, hold=hold,
                                  live=False, t0=t0, retry=False)

    def _dcp_writer(self, sd: dict[str, Any], group: Any, validate: bool,
                    cancel: Any = None) -> Callable[[str], None]:
        def write(key: str) -> None:
            self._dcp_save(sd, key, group, cancel)
            if validate:  # written from live tensors: still the state of S at the end of the write?
                why = self._watch.changed(getattr(self, "_live_mark", None))
                self._live_moved = why
                if why is not None:
                    raise StateMoved(f"the state moved while it was written from live tensors: {why}")
        return write

    def _periodic_flags(self) -> tuple[int, int]:
        p = self._periodic
        if p is None or self._life.detached():
            return 0, 0
        return p.flags()

    def _periodic_due(self) -> bool:
        """The boundary reduction just collected agreed on a periodic save (every rank sees the same flags)."""
        if self._periodic is None or self._life.detached():
            return False
        due, busy = self._agree.flags[:2]
        return bool(due) and not busy

    def _maybe_periodic(self, snap: Optional[Snapshot]) -> None:
        """At a boundary with no notice: start the agreed periodic save."""
        p = self._periodic
        if p is None or not self._periodic_due():
            return
        self._internal = True
        try:
            t0 = time.monotonic()
            state, nbytes = stage_state_dict(self._save_state_dict(snap))
            p.start(self._steps.count, state, nbytes, time.monotonic() - t0)
        finally:
            self._internal = False

    def _settle_periodic(self, notice: Notice, group: Any = _OWN) -> None:
        """A notice-driven save is about to start (every rank): finish or abort an in-flight periodic one.

        Rule (decided on rank 0, broadcast): finish it if its own throughput says it
        ends within half of the time left (cut off at that half whatever happens),
        else abort it; the notice's checkpoint is written next either way.
        """
        p = self._periodic
        if p is None:
            return
        left = max(0.0, notice.seconds_left() - SAVE_MARGIN)
        decision = p.decide(self._steps.count, left) if self._rank == 0 else None
        what, est = self._bcast0(decision, group)
        if what == "idle" and not p.busy:
            return
        committed, waited = p.settle(what, left)
        self._log.info(PERIODIC_SETTLED, notice_id=notice.id, step=p.job.step if p.job else None, decision=what,
                       estimate=None if est is None else round(est, 3), seconds_left=round(left, 3),
                       waited=round(waited, 3), committed=committed)
