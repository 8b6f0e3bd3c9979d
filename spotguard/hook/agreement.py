"""Agreement: every rank reads the same (level, earliest deadline, step) and acts on it.

Two ways to reach it:

**Background agreement** (``BackgroundAgreement``; the plain-PyTorch hook with
optimizer step hooks under ``torch.distributed``, one optimizer): a thread per
rank with its *own* gloo group (only that thread ever uses it, so every rank
issues its collectives in the same order) and its own connection to the c10d
store (``Store.clone()``). Event-driven, nothing per step: the thread blocks in
``store.wait`` on its own key ``<token>/wake/<g>/<rank>``. A rank that receives a
notice (daemon intake thread, signal thread, ``notify``) sets every rank's key of
round ``g`` in one ``multi_set`` (value: the notice deadline in ms), which wakes
every rank's thread at once; a rank that closes sets only its own (``release``). Each thread
then *joins* round ``g``: under the hook's step lock it records the count its
training thread will stand at (``c``, or ``c+1`` when it is inside
``optimizer.step``) and from then on the training thread may not start an
optimizer step past it (held in the pre-hook, bounded by the deadline). One
``all_gather_object`` of ``(level, deadline, stand, best notice)`` decides:
level = MAX, deadline = MIN, the step to save ``S`` = MAX of the stands (DDP
ranks differ by at most one; a laggard trains on to ``S`` needing no
collective from the ranks already there). The checkpoint is then written from
this same thread (``staged.py``: ``_save_staged``), and the exit follows it
(``exit.py``: ``_exit_from_background``). The training thread is held at its
next pre-hook until the tensors of S are copied; after that, an ordinary
(rebalance/maintenance) checkpoint releases it, while an emergency keeps it
held until the exit. Why (a departure from "hold only until the copy"): the
steps an emergency lets run after S are thrown away anyway, and running them
costs the user side effects that the resumed run repeats (logged metrics,
records written per step), and CPU, PCIe and network that the upload needs in
the VM's last seconds; the hold itself costs nothing, since the process leaves
right after the commit, and cannot deadlock (the save's collectives are the
agreement thread's, on its own group). The training thread goes on meanwhile
with whatever it was doing (forward/backward, evaluation, data loading). Why the store and not a periodic
all-reduce: a blocked ``store.wait`` costs nothing per step (measured in
docs/performance.md), and a notice reaches every rank in one store round trip.
Why a generation key rather than one flag: rounds are numbered, every rank
takes part in round ``g`` exactly once, and a notice that arrives while round
``g`` runs is picked up by round ``g+1`` (before waiting for ``g+1`` a thread
with a pending notice of level > 0 sets that key itself).

Every collective of a round runs under a group timeout of the time left to
the deadline minus ``SAVE_MARGIN``: a peer that never joins makes the round
fail in bounded time ("peers lost": exit 75, nothing committed).

**A single process** (no ``torch.distributed``): ``LocalAgreement`` (``rounds.py``, beside the thread), the same
rounds with a dict of wake keys instead of the store and no collective.

**Explicit loops** (``hook.range()``/``hook.step()``): the optimizer clock counts and
each loop boundary proves that one clock step ran in the iteration (``boundary.py``:
``_clocked_boundary``); a round saves only a proven step, else hands its notice to
the boundary path (``_hand_over``; every rank alike: the gathered entries carry why).
With several optimizers the boundary itself counts the iteration (after checking each
optimizer's steps in it) and every optimizer's pre-hook is held.

**At the step boundary** (framework adapters, several optimizers in an implicit loop, explicit loops
whose optimizer steps do not map one to one onto iterations, or when the store
cannot be reached): the flag all-reduce launched at an iteration's end and read
at the next boundary (``dist.Agreement``); then each rank enters ``_plan``
(all-gather of the notice to act on, the ``agreed`` log line) and
``_carry_out`` (exit, emergency save + exit, or an ordinary save), split so that
a framework adapter can let its trainer write between the two.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..notice import Notice
from ..timefmt import utcnow
from . import events as ev
from .doomed import doomed_ranks
from .dist import (
    NO_DEADLINE_MS,
    group_alive,
    set_group_timeout,
)
from .outcome import _Result
from .rounds import BackgroundAgreement, LocalAgreement, RoundFailed  # noqa: F401 - re-exported (core)
from .settings import (
    _ACTIONS,
    HANDED_OVER,
    LEVEL_EMERGENCY,
    LEVEL_REPLAY,
    SAVE_MARGIN,
    SIGNAL_GRACE,
    _ms,
)
from .state import Snapshot


def agreed_notice(step: int, deadline_ms: Optional[int], detail: str = "") -> Notice:
    """The notice to act on when no rank holds one any more (withdrawn after agreeing, or peers lost): a
    termination at ``deadline_ms`` (epoch ms, a past one = now; None or ``NO_DEADLINE_MS``: ``SIGNAL_GRACE``
    from now)."""
    now = utcnow()
    if deadline_ms is None or deadline_ms >= NO_DEADLINE_MS:
        deadline = now + timedelta(seconds=SIGNAL_GRACE)
    else:
        deadline = now + timedelta(milliseconds=max(0, deadline_ms - _ms(now)))
    return Notice(id=f"agreed-{step}", source="signal", kind="termination", deadline=deadline, received_at=now,
                  detail=detail)


def best_candidate(cands: list[Any]) -> Optional[Notice]:
    """The notice to act on among the ranks' ``(level, deadline_ms, wire)`` candidates: highest level, then
    earliest deadline; None when no rank has one."""
    cands = [c for c in cands if c is not None]
    return Notice.from_wire(max(cands, key=lambda c: (c[0], -c[1]))[2]) if cands else None


def _round_end(deadline_ms: int) -> float:
    """Monotonic time by which a round's work must be over: the deadline less ``SAVE_MARGIN`` (at most half
    the time left), at least 1 s from now; ``SIGNAL_GRACE`` when there is no deadline."""
    left = SIGNAL_GRACE if deadline_ms >= NO_DEADLINE_MS else (deadline_ms - _ms(utcnow())) / 1000.0
    return time.monotonic() + max(1.0, left - min(SAVE_MARGIN, max(0.0, left) / 2))


class AgreementMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def _action_for(self, level: int, step: int) -> str:
        """The agreed level's action when the checkpoint would stand for ``step``."""
        if level == LEVEL_REPLAY and step != self._resumed_step:
            return "emergency"  # we trained past the committed step before learning of the replay
        return _ACTIONS[level]

    def _gather_notice(self, level: int, deadline_ms: int) -> tuple[Notice, list[str]]:
        """After agreement every rank enters this: the notice to act on (from whichever rank has it)."""
        mine = (self._best_local(), self._doomed_here())
        if self._dist and group_alive(self._group):
            got: list[Any] = [None] * self._world
            dist.all_gather_object(got, mine, group=self._group)
        else:
            got = [mine]
        allv = [g[0] for g in got]
        self._doomed = doomed_ranks(g[1] for g in got)  # the save plans replicated items onto the others
        ids = [c[2]["id"] for c in allv if c is not None]
        best = best_candidate(allv)
        return best or agreed_notice(self._steps.count, deadline_ms, "notice withdrawn after agreement"), ids

    def _act(self, level: int, deadline_ms: int, *, snap: Optional[Snapshot], final: bool) -> None:
        self._internal = True
        try:
            plan = self._plan(level, deadline_ms, final=final)
            if plan is not None:
                self._carry_out(plan, snap)
        finally:
            self._internal = False

    def _plan(self, level: int, deadline_ms: int, *, final: bool) -> Optional[tuple[Notice, list[str], str]]:
        """After agreement (every rank): the notice and the action, logged as ``agreed``; None = nothing to do.

        Split from ``_carry_out`` so that a framework adapter can let its trainer
        write the checkpoint between the two (Hugging Face: ``control.should_save``).
        """
        try:
            notice, ids = self._gather_notice(level, deadline_ms)
        except Exception as exc:  # noqa: BLE001 - a peer vanished right after agreeing
            notice = agreed_notice(self._steps.count, None, "peers lost while sharing the notice")
            if level >= LEVEL_EMERGENCY:
                self._log.warning("peers lost while sharing the notice", error=repr(exc))
                self._exit(notice, _Result(committed=False, peers_ok=False, error=repr(exc)))
            return None
        action = self._action_for(level, self._steps.count)
        self._log.info(ev.AGREED, notice_id=notice.id, step=self._steps.count, flag=level, action=action,
                       kind=notice.kind, **self._timing(notice))
        if final:
            self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=notice.id, step=self._steps.count)
            self._forget(ids)
            self._doomed = None  # no save follows: a later (torchft) save must not plan with this set
            return None
        return notice, ids, action

    def _carry_out(self, plan: tuple[Notice, list[str], str], snap: Optional[Snapshot]) -> None:
        """Exit (replay), emergency save + exit (never returns), or an ordinary save and keep training."""
        notice, ids, action = plan
        if action == "periodic":  # a framework adapter's every= checkpoint: no notice involved
            self._save(notice, "periodic", snap)
            self._doomed = None
            set_group_timeout(self._group, 1800.0)
            return
        if action == "exit":
            self._exit(notice, None)
        if action == "emergency":
            self._exit(notice, self._save(notice, "emergency", snap))
        self._save(notice, "manual", snap)  # ordinary checkpoint, keep training
        self._doomed = None
        self._forget(ids)
        set_group_timeout(self._group, 1800.0)


    # ------------------------------------------------------- background rounds

    def _background_round(self, gen: int, wake_deadline_ms: int) -> None:
        """The agreement thread, every rank, round ``gen`` (see the module docstring). Never raises."""
        bg = self._bg
        if self._life.stopping():
            return
        # Bounded by the earliest deadline known here (this rank's own notices and the waker's), then by the
        # agreed earliest one: a short preemption joining a round woken by a far-off notice is never held
        # to the far deadline.
        level, deadline_ms = self._local_level()
        t_end = _round_end(min(wake_deadline_ms, deadline_ms))
        # A rank still inside resume() joins once it is over: the decision reads its count and resumed step.
        self._bg_ready.wait(max(0.0, t_end - time.monotonic()))
        stand = self._steps.join_round(t_end)  # from here the training thread starts no step past `stand`
        level, deadline_ms = self._local_level()
        try:
            allv = bg.gather((level, deadline_ms, stand, self._best_local(), self._loop.range_broken, self._doomed_here()),
                             max(0.5, t_end - time.monotonic()))
        except RoundFailed as exc:
            if self._peers_finished(t_end):
                return
            notice = self._best_notice() or agreed_notice(self._steps.count, wake_deadline_ms,
                                                          "peers lost during the agreement")
            self._exit_from_background(notice, _Result(committed=False, peers_ok=False, error=str(exc)), None,
                                       lost_where="agreement")
            return
        level = max(int(v[0]) for v in allv)
        deadline_ms = min(int(v[1]) for v in allv)
        step = max(int(v[2]) for v in allv)
        doomed = doomed_ranks(len(v) > 5 and v[5] for v in allv)  # who writes replicated items (doomed.py)
        if deadline_ms < NO_DEADLINE_MS:  # every later bound (hold, copy, save) from the agreed earliest deadline
            t_end = min(t_end, _round_end(deadline_ms))
            self._steps.bound_hold(t_end)
        if level <= 0:
            self._release_hold()
            return
        broken = next((v[4] for v in allv if len(v) > 4 and v[4]), None)
        if broken is not None:  # an explicit loop left the any-moment path (on some rank): its boundary acts
            self._hand_over(step, broken)
            return
        notice = best_candidate([v[3] for v in allv]) or agreed_notice(step, deadline_ms,
                                                                       "notice withdrawn after agreement")
        ids = [v[3][2]["id"] for v in allv if v[3] is not None]
        self._steps.agree(step)
        action = self._action_for(level, step)
        self._log.info(ev.AGREED, notice_id=notice.id, step=step, flag=level, action=action, kind=notice.kind,
                       via="background", stands=[int(v[2]) for v in allv], **self._timing(notice),
                       **({"doomed": sorted(doomed)} if doomed else {}))
        nothing, already = self._standing(step)
        if action == "exit" or ((nothing or already) and action == "emergency"):
            self._exit_from_background(notice, None, step)
            return
        if nothing or already:  # an ordinary checkpoint of a state that is already safe (or empty): say so
            self._log.info(ev.CHECKPOINT_SKIPPED, notice_id=notice.id, step=step,
                           reason="nothing_to_save" if nothing else "already_committed")
            self._release_hold()
            self._forget(ids)
            return
        reason = "emergency" if action == "emergency" else "manual"
        if action == "emergency":
            self._install_excepthook(notice, t_end)
        self._round_action = action
        self._doomed = doomed  # only for this round's own save: a round that returns earlier leaves none behind
        try:
            result = self._save_staged(notice, reason, step, t_end, bg.group, hold=action == "emergency")
        except Exception as exc:  # noqa: BLE001 - contained: the round fails, training goes on (or exits 75)
            result = self._fail(notice, step, f"background save: {type(exc).__name__}: {exc}", time.monotonic(),
                                peers_ok=True)
        finally:
            self._round_action = None
            self._doomed = None  # this round's: a later save (torchft's, an adapter's) learns its own
        if result.error == HANDED_OVER:  # every rank alike: no rank entered the save's collectives
            self._hand_over(step, self._loop.range_broken or "")
            return
        if result.step is not None:  # the exact fallback committed the next iteration's end
            step = result.step
        if action == "emergency":
            self._exit_from_background(notice, result, step)
            return
        self._release_hold()
        self._forget(ids)  # a failed ordinary checkpoint is not retried in a loop: checkpoint_failed said so
        cancelled = self._ordinary_cancel.is_set()
        self._ordinary_cancel.clear()
        if result.committed:
            bg._fails = 0
        elif not cancelled:
            bg.backoff()
        set_group_timeout(bg.group, 1800.0)

    def _peers_finished(self, t_end: float) -> bool:
        """Whether the round failed because every other rank had finished its loop (each said bye from
        ``destroy_process_group()`` or ``hook.close()``). DDP lets a rank finish once the last all-reduce is
        done, while this rank still runs its last optimizer step and scheduler: the job's work is over and
        nothing can be agreed any more. Exiting 75 here would make the launcher kill the peers' teardown (a
        final save of the user's) and restart a finished job; so the notice is one after the last step —
        logged so, forgotten, training goes on to its end with its own exit code."""
        watch = getattr(self, "_peers", None)
        if watch is None or not watch.all_ended(max(0.0, min(2.0, t_end - time.monotonic()))):
            return False
        self._bg_on = False
        best = self._best_notice()
        with self._lock:
            ids = list(self._pending)
        self._forget(ids)
        self._release_hold()
        self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=best.id if best is not None else None, step=self._steps.count,
                       why="every other rank had finished its last step: nothing left to agree on")
        return True

    def _hand_over(self, step: int, why: str) -> None:
        """The round's step is not one the explicit loop proved to end an iteration (it stepped twice, or not
        at all, in one iteration): nothing is saved here; the notices stay pending and the loop's boundary
        path acts on them at its next boundary (exact there, one iteration later)."""
        with self._steps.cv:
            self._break_clock(why)  # every rank leaves the clock at the same boundary, so their reductions match
        self._log.warning(ev.CHECKPOINT_FALLBACK, step=step, reason=why,
                          waits_for="the loop's next iteration boundary (boundary path)")
        self._release_hold()

    def _best_notice(self) -> Optional[Notice]:
        best = self._best_local()
        return Notice.from_wire(best[2]) if best is not None else None
