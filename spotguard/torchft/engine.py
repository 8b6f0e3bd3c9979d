"""Spot notices for torchft replica groups: the noticed group leaves, the others keep training.

Why an engine of its own: with torchft every replica group holds the whole
training state, so stopping the job for one reclaimed node wastes the
survivors' time. ``ReplicaGuard`` sits on top of the plain ``Hook`` (its
daemon intake, signals, storage and emergency checkpoint) and changes what a
notice means:

* A notice only marks this group as *leaving*; the hook itself ignores it.
* Every step, before ``should_commit``, the groups exchange one tiny SUM
  all-reduce through torchft's own manager: ``[leaving, participating]``. So
  every group learns in the same step who leaves (torchft's quorum is the
  step-boundary agreement; no side channel).
* If that step commits, the leaving groups stop there: no uncommitted step, no
  quorum joined for the next one. The survivors' next quorum drops them after
  the lighthouse's ``join_timeout_ms`` (≥ 3 groups) or ``heartbeat_timeout_ms``
  (2 groups); it runs during their forward/backward pass (async quorum), so
  the stall is that timeout minus the compute time, floored at 0
  (``lighthouse_args`` picks the timeouts, docs/torchft.md the numbers).
* If every participating group leaves in the same step (the whole job is
  reclaimed), the group of replica rank 0 writes the usual emergency
  checkpoint to storage (state is replicated: one copy is enough); the others
  wait for its commit and rank 1 writes the step itself if none comes by
  ``deadline - lead`` (``failover.py``); ``resume()`` loads it on restart, as
  without torchft.

* **Deadline fallback.** A noticed group that has not left by ``deadline - lead``
  (``fallback_lead``: 40 % of the notice, 1-20 s; the last group cannot commit
  alone under ``min_replica_size >= 2``, a stalled quorum or lighthouse) writes
  the emergency checkpoint itself: the state of its last committed step, from a
  watchdog thread while the training thread is inside an iteration (its next
  optimizer step is held, so the state cannot move under the write), or at the
  loop's next training forward when the loop is still in the post-step work of
  that step. A write that has not started by the deadline ends the process with
  75 and an error naming why (never an unbounded wait, never a silent loss).
  A group of several processes writes with all its ranks (``group_fallback.py``).

* A loop whose steps commit without the vote (torchft's ``LocalSGD``/``DiLoCo``, which call
  ``should_commit`` inside the optimizer's post-hook; its ``OptimizerWrapper``) is refused at install or at
  its first step with ``UnsupportedLoop`` naming why (``refusal.py``), not found out at the notice.

A replacement group started later heals from a survivor through torchft's
checkpoint transport (``Manager(load_state_dict=..., state_dict=...)``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..hook.core import EXIT_SAVE_FAILED, Hook, Preempted
from ..hook.dist import all_max
from ..hook.save import _BG
from ..hook.settings import env_seconds
from ..hook.state import PER_RANK, Snapshot
from ..history.writer import tap as history_tap
from ..logs import get_logger
from ..notice import Notice
from .group_fallback import GroupFallback
from .failover import BY_PEER, FAILOVER, UNCONFIRMED, await_writer, committed_at, write_step  # noqa: F401
from .refusal import REFUSED, CommitGate, StepCheck, UnsupportedLoop, local_sync_in_use, refusal, wrapper_in_state

__all__ = ["ReplicaGuard", "GuardedOptimizer", "lighthouse_args", "vote_device", "fallback_lead", "LEAVING", "LEFT",
           "PEER_LEAVING", "STEP", "FALLBACK", "FALLBACK_MISSED", "HEAL_STATE",
           "REFUSED", "UnsupportedLoop", "FAILOVER", "BY_PEER", "UNCONFIRMED"]

# timeline events (structlog ``event``), in addition to the hook's
LEAVING = "replica_leaving"  # notice_id: this group will leave at the next committed step
PEER_LEAVING = "replica_peer_leaving"  # step, leaving, participants: others leave after this step
LEFT = "replica_left"  # notice_id, step: this group left after committed step ``step``
ALL_LEAVING = "replica_all_leaving"  # step: every group leaves: emergency checkpoint
STEP = "replica_step"  # step, participants, committed (only with ``log_steps``)
HEAL_STATE = "replica_heal_state"  # by (guard | manager), keys: what a healing group takes from a survivor
FALLBACK = "replica_fallback"  # notice_id, step, seconds_left, where: not left by deadline - lead: writing itself
FALLBACK_MISSED = "replica_fallback_missed"  # notice_id, step, why, fix: nothing written by the deadline (exit 75)


def fallback_lead(seconds_left: float) -> float:
    """How long before its deadline a noticed group that has not left writes its own checkpoint.

    40 % of the notice (a normal leave needs one committed step; the rest is the
    save's), at least 1 s, at most 20 s (a replicated state written by one group;
    ``SPOTGUARD_TORCHFT_FALLBACK_LEAD`` sets it in seconds for larger states).
    """
    if os.environ.get("SPOTGUARD_TORCHFT_FALLBACK_LEAD", "").strip():
        return env_seconds("SPOTGUARD_TORCHFT_FALLBACK_LEAD", 10.0)
    return min(20.0, max(1.0, 0.4 * seconds_left))


def lighthouse_args(*, groups: int, step_seconds: float, min_replicas: int = 1,
                    notice_lead_seconds: float = 30.0) -> list[str]:
    """``torchft_lighthouse`` flags for a job whose groups leave on spot notices.

    Why these values: a group that leaves cleanly stays "healthy" (heartbeating
    until it shuts down, then for ``heartbeat_timeout_ms``), so with ≥ 3 groups
    the survivors' quorum waits ``join_timeout_ms`` for it, with 2 groups the
    heartbeat timeout (split-brain rule). The quorum runs during the forward
    pass, so a join timeout at or below one step's compute costs no stall.
    A late joiner only waits for the next quorum; but below ~200 ms ordinary
    jitter on a loaded machine made quorums flap here (a new quorum every step,
    one group healing every step), hence the floor.
    The heartbeat timeout stays well under the notice lead time so a group
    killed without a notice is also dropped before the deadline of the next one.
    """
    if groups < 1 or step_seconds <= 0:
        raise ValueError("groups must be >= 1 and step_seconds > 0")
    join_ms = max(200, min(1000, int(step_seconds * 1000 * 0.8)))
    tick_ms = max(10, min(100, join_ms // 4))
    heartbeat_ms = max(1000, min(5000, int(notice_lead_seconds * 1000 / 10)))
    return ["--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_ms),
            "--quorum_tick_ms", str(tick_ms), "--heartbeat_timeout_ms", str(heartbeat_ms)]



def vote_device(pg: Any) -> torch.device:
    """Where the leave vote's tensor lives: on the device torchft's process group reduces (issue 25: a CPU
    tensor through ``ProcessGroupNCCL``, which registers only a CUDA backend, failed every all-reduce, so
    ``should_commit`` was False at every step of a GPU job)."""
    for _ in range(8):  # torchft's wrappers (ErrorSwallowingProcessGroupWrapper(ProcessGroupNCCL())) hold it in _pg
        name = type(pg).__name__.upper()
        if "NCCL" in name:
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")
        if "XCCL" in name:
            return torch.device("xpu")
        if "GLOO" in name:
            return torch.device("cpu")
        inner = getattr(pg, "_pg", None)
        if inner is None or inner is pg:
            break
        pg = inner
    return torch.device("cpu")


class _EngineHook(Hook):
    """The torchft engine decides itself when a notice stops the job (the leave vote at ``should_commit``,
    ``emergency_exit`` when every group leaves): no any-moment round of the hook's own may act beside it."""

    _background_capable = False
    _warn_skipped_steps = False  # an uncommitted step skips optimizer.step() by design; after_step() keeps the count

    guard: Optional["ReplicaGuard"] = None  # set by the guard that built it

    def _periodic_flags(self) -> tuple[int, int]:
        """``every=``: only the writer group is ever due (its in-flight upload still counts as busy) — replica
        rank 0 of the quorum that committed the step just taken (the one written at the next boundary), asked
        now: the rank remembered at the step before lagged a quorum change by one step (two writers of a step)."""
        due, busy = super()._periodic_flags()
        writer = self.guard is not None and self.guard.manager.participating_rank() == 0
        return (due if writer else 0), busy

class ReplicaGuard:
    """Notices for one torchft replica group (one per process; every rank of the group builds one).

    ``state`` is what the emergency checkpoint holds (model, optimizer, ...),
    the same mapping ``install_preemption_hook`` takes; ``storage`` where it
    goes; ``every``/``keep`` as for ``install_preemption_hook`` (periodic
    checkpoints, written by the group with replica rank 0 only: the state is
    replicated). Use ``optimizer()`` for the training loop, or call ``iteration_start()``
    before each ``manager.start_quorum()``, ``vote()`` before
    ``manager.should_commit()`` and ``after_step(committed)`` after it (a ``should_commit()`` that no
    ``vote()`` preceded raises ``UnsupportedLoop``, as LocalSGD/DiLoCo do at install or their first step).
    """

    def __init__(self, manager: Any, state: Mapping[str, Any], storage: Any = None, *,
                 socket: Optional[str] = None, exit_code: int = 143, log_steps: bool = False,
                 on_notice: Optional[Callable[[Notice], Any]] = None, every: Optional[float] = None,
                 keep: Optional[int] = None) -> None:
        self.manager = manager
        # periodic checkpoints (every=): the state is replicated, so one group writes them — the one with replica
        # rank 0 in the last committed step's quorum (every process of that group: the shards are its own;
        # _EngineHook._periodic_flags)
        self._user_cb = on_notice
        self._lock = threading.Lock()
        self._notice: Optional[Notice] = None  # the notice this group leaves for (first one wins)
        self._watch_deadline: Any = None  # the nearest deadline a watchdog watches (datetime)
        self._voted: Optional[Notice] = None  # the notice our vote of this step stands for
        self._tally: Optional[tuple[int, int]] = None  # (leaving, participants) of this step
        # a whole-job leave decided at step S, written once the loop's post-step work of S (scheduler, EMA) is
        # over: at the first training forward after the step, at iteration_start() or at close()
        self._pending: Optional[tuple[Notice, Optional[int], Optional[Snapshot]]] = None
        self._replica_rank = 0  # in a whole-job leave: this group's rank in the last quorum (0 writes)
        self._heard_from_group = False  # this rank learnt of its group's notice from another rank (logged once)
        # the loop calls iteration_start() (GuardedOptimizer.zero_grad, or a loop driving vote()/after_step()
        # that follows docs/torchft.md); one that never did would hit its next start_quorum() on the shut-down
        # manager with nothing written, so it gets the write at the step instead (before its scheduler step)
        self._starts_seen = False
        self._exit_code = exit_code
        self._log_steps = log_steps
        # deadline fallback: where the loop is ("post": between a committed step and the next training forward,
        # the loop's post-step work may still change the state; "iter": inside an iteration, the state is that
        # of the last committed step; "stepping": inside the optimizer's step), whether the fallback holds the
        # optimizer, and whether the group is done with its notice
        self._phase = "post"
        self._fallback_on = False
        self._done = threading.Event()
        # a write started or the group left (Preempted): a fallback deferred to the training thread has nothing
        # left to do (a process that lingers after leaving must not be ended with 75 "missed" at the deadline)
        self._over = threading.Event()
        self._halt = threading.Event()  # never set: an optimizer step held by the fallback waits for the exit
        self._watchdog: Optional[threading.Thread] = None
        wrapper_key = wrapper_in_state(state)
        if wrapper_key is not None:  # before the hook: it cannot hook an Optimizer whose __init__ never ran
            name, why, fix = refusal("OptimizerWrapper")
            get_logger("spotguard.torchft", component="hook").error(REFUSED, what=name, key=wrapper_key, why=why,
                                                                    fix=fix)
            raise UnsupportedLoop(name, why, fix)
        self.hook = _EngineHook(state, storage, socket=socket, exit_code=exit_code, on_notice=self._on_notice,
                                every=every, keep=keep)
        self.hook.guard = self
        self._log = history_tap(get_logger("spotguard.torchft", component="hook", rank=self.hook._rank),
                                getattr(self.hook, "_history", None))  # leaves/heals in the history
        # a loop the leave vote cannot ride on (LocalSGD/DiLoCo, a should_commit() without vote()) is refused
        # here, at its first optimizer step or at that should_commit(): not at the notice (refusal.py)
        found = local_sync_in_use(manager, self.hook._objs.optimizers.values())
        if found is not None:
            self.hook.close()
            self._refuse(found)
        self._commit_gate, _ = CommitGate.on(manager, self._unvoted)
        self._step_check = StepCheck(manager)
        # LocalSGD/DiLoCo on an optimizer the guard's dict does not hold (a Stateful wrapper of model and
        # optimizer, a second optimizer): every optimizer's step is looked at, not only the dict's, else the
        # loop ran sync_every inner steps before the commit gate refused it at the first sync
        self._any_step = register_optimizer_step_pre_hook(self._any_optimizer_step)
        self._register_heal_state()
        # a group of several processes: every rank writes its part of a deadline fallback together
        self._group_fb = GroupFallback(self) if self.hook._group is not None else None
        self._fwd_handles = [m.register_forward_pre_hook(self._on_forward) for m in self.hook._objs.models.values()]
        self._gate_handles = [o.register_step_pre_hook(self._gate) for o in self.hook._objs.optimizers.values()]

    # ------------------------------------------------------------------ heals

    def heal_items(self) -> dict[str, Any]:
        """What a healing group takes from a survivor: the replicated part of the dict (models, optimizers,
        schedulers, scalers, global stateful objects) — never the loaders or per-rank objects (each group
        reads its own data)."""
        o = self.hook._objs
        items: dict[str, Any] = {**o.models, **o.optimizers, **o.schedulers, **o.scalers}
        items.update({k: v for k, v in o.stateful.items() if o.scope.get(k) != PER_RANK})
        return items

    def _register_heal_state(self) -> None:
        """Declare the state once (issue 25): the guard's dict is also what torchft's heal transports, unless
        the Manager was given its own ``load_state_dict``/``state_dict`` (then those are used, and they must
        hold every replicated item: a scheduler missing there leaves a healed group with a fresh one)."""
        register = getattr(self.manager, "register_state_dict_fn", None)
        if not callable(register):
            return
        items = self.heal_items()
        theirs = sorted(getattr(self.manager, "_user_state_dicts", None) or {})
        earlier = getattr((getattr(self.manager, "_user_state_dicts", None) or {}).get("spotguard"),
                          "__spotguard_guard__", None)
        replace = earlier is not None and earlier.hook._life.closed  # a closed guard's objects are not this one's
        if "spotguard" in theirs and not replace:  # a guard built before on this Manager registered (torchft asserts
            self._log.info(HEAL_STATE, by="earlier-guard", keys=theirs, guard_keys=sorted(items),  # on a 2nd)
                           why="an earlier ReplicaGuard on this Manager registered its items; heals use those")
            return
        if theirs and not replace:
            self._log.info(HEAL_STATE, by="manager", keys=theirs, guard_keys=sorted(items),
                           why="the Manager has its own state_dict callbacks: heals use them; they must hold "
                               "every item listed in guard_keys")
            return

        def state_dict() -> dict[str, Any]:
            return {k: v.state_dict() for k, v in items.items()}

        def load_state_dict(sd: dict[str, Any]) -> None:
            missing = sorted(set(items) - set(sd))
            if missing:
                raise KeyError(f"heal state lacks {missing}: the survivor's ReplicaGuard holds other items")
            for k, v in items.items():
                v.load_state_dict(sd[k])
            self.hook._steps.set_count(self.manager.current_step())  # the state is that step's (a deadline fallback)

        state_dict.__spotguard_guard__ = self  # type: ignore[attr-defined]
        if replace:  # torchft has no unregister: a closed guard's callbacks are overwritten in place
            self.manager._user_state_dicts["spotguard"] = state_dict
            if isinstance(getattr(self.manager, "_load_state_dict_fns", None), dict):
                self.manager._load_state_dict_fns["spotguard"] = load_state_dict
        else:
            register("spotguard", load_state_dict, state_dict)
        self._log.info(HEAL_STATE, by="guard", keys=sorted(items), replaced_closed_guard=replace)

    # ------------------------------------------------------------------ notices

    def _on_notice(self, notice: Notice) -> bool:
        """Intake/signal thread: remember it; the hook must not checkpoint for it (return False)."""
        if self._user_cb is not None and self._user_cb(notice) is False:
            return False
        with self._lock:
            first = self._notice is None
            if first:
                self._notice = notice
            # a later notice with a nearer deadline (a SIGTERM's grace after a far notice) brings the fallback
            # forward: a watchdog of its own (the group still leaves for the first; one write at most, _fallback)
            watch = first or notice.deadline < self._watch_deadline
            if watch:
                self._watch_deadline = notice.deadline
        if first:
            self._log.info(LEAVING, notice_id=notice.id, step=self.manager.current_step(),
                           seconds_left=round(notice.seconds_left(), 3))
        if watch:
            self._watchdog = threading.Thread(target=self._deadline_watch, args=(notice,), daemon=True,
                                              name="spotguard-replica-deadline")
            self._watchdog.start()
        return False

    def notify(self, notice: Notice) -> None:
        """Hand the guard a notice yourself (tests, custom sources): same path as the daemon's."""
        self.hook.notify(notice)

    @property
    def leaving(self) -> bool:
        return self._notice is not None

    # --------------------------------------------------------------- training

    def resume(self) -> int:
        """Load the newest committed checkpoint from storage (0 if none) and set the manager's step to it."""
        step = self.hook.resume()
        if step:
            sd = self.manager.state_dict()
            sd["step"] = step
            self.manager.load_state_dict(sd)
        return step

    def optimizer(self, optim: torch.optim.Optimizer) -> "GuardedOptimizer":
        return GuardedOptimizer(self, optim)

    def vote(self) -> None:
        """Collective over the replica groups, before ``should_commit``: who leaves after this step."""
        from torch.distributed import ReduceOp  # noqa: PLC0415

        notice = self._group_notice()
        t = torch.tensor([1 if notice is not None else 0, 1], dtype=torch.int64,
                         device=vote_device(getattr(self.manager, "_pg", None)))

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        self._voted = notice
        leaving, voters = t.tolist()
        self._tally = (int(leaving), int(voters))
        self._commit_gate.armed = True  # the next should_commit() carries this vote

    def _refuse(self, what: Optional[str]) -> None:
        """Log ``replica_refused`` and raise ``UnsupportedLoop`` (``what``: LocalSGD/DiLoCo, None: no vote)."""
        name, why, fix = refusal(what)
        self._log.error(REFUSED, what=name, step=self.manager.current_step(), why=why, fix=fix)
        raise UnsupportedLoop(name, why, fix)

    def _unvoted(self) -> None:
        """``should_commit()`` with no ``vote()`` before it (the commit gate): refused, naming the caller's kind."""
        self._refuse(local_sync_in_use(self.manager, self.hook._objs.optimizers.values()))

    def _group_notice(self) -> Optional[Notice]:
        """This group's notice, agreed by its ranks (MAX over the group) when it has several processes.

        torchft reduces across groups rank by rank, so every rank of a group must
        vote alike, although only the ranks on the noticed node got the notice.
        Ranks without it stand in a notice with a fixed id and the group's nearest
        deadline (carried in the same all-reduce: a whole-job leave's wait for the
        writer and its failover must not run on a made-up deadline).
        """
        notice = self._notice
        group = self.hook._group
        if group is None:
            return notice
        far = 2 ** 62  # no notice here: no deadline (MAX of minus the deadline in ms = the nearest one)
        noticed, neg_deadline_ms = all_max(group, [1 if notice is not None else 0,
                                                   -int(notice.deadline.timestamp() * 1000) if notice is not None
                                                   else -far])
        if noticed and notice is None:
            from datetime import datetime, timezone  # noqa: PLC0415

            from ..timefmt import utcnow  # noqa: PLC0415

            notice = Notice(id=f"replica-leave-{self.manager.current_step()}", source="signal",
                            kind="termination",
                            deadline=datetime.fromtimestamp(-neg_deadline_ms / 1000, tz=timezone.utc),
                            received_at=utcnow(), detail="another rank of this replica group got the notice")
            if not self._heard_from_group:
                self._heard_from_group = True
                self._log.info(LEAVING, notice_id=notice.id, step=self.manager.current_step(), via="group",
                               seconds_left=round(notice.seconds_left(), 3))
        return notice

    def after_step(self, committed: bool) -> None:
        """After ``should_commit``: leave, fall back to storage, or keep going (survivors)."""
        tally, self._tally = self._tally, None
        voted, self._voted = self._voted, None
        step = self.manager.current_step()
        participants = self.manager.num_participants()
        if self._log_steps:
            self._log.info(STEP, step=step, participants=participants, committed=committed,
                           t=round(time.time(), 4))
        if committed:
            # the hook counts this step too (its post-hook): keep its count on the manager's step, which a heal
            # moves, so that what it took at the next forward (buffers, RNG) is found for this step's label
            self.hook._steps.set_count(step)
            with self._lock:
                self._phase = "post"  # the loop's post-step work of this step (scheduler, EMA) comes next
        if not committed or tally is None:
            return  # the step is redone: nobody leaves at an uncommitted step
        leaving, voters = tally
        if leaving == 0:
            return
        if voted is None:  # a survivor (a healing group's zero vote included: it holds the state too)
            self._log.info(PEER_LEAVING, step=step, leaving=leaving, participants=voters)
            return
        if leaving >= voters:
            self._all_leave(voted, step)
            if self._pending is not None:
                return  # the writer finishes this iteration first (its scheduler step is part of S)
        self._leave(voted, step)

    def _leave(self, notice: Notice, step: int) -> None:
        self._done.set()
        self._over.set()
        self._log.info(LEFT, notice_id=notice.id, step=step, seconds_left=round(notice.seconds_left(), 3))
        self.manager.shutdown(wait=False)
        self.hook._flush_intake()
        self.hook.close()
        # committed=False: no checkpoint was written for it (the state lives on in the survivors)
        raise Preempted(self._exit_code, notice_id=notice.id, step=step, committed=False)

    def _all_leave(self, notice: Notice, step: int) -> None:
        """Every participating group leaves: replica rank 0 writes the emergency checkpoint, the others wait
        for its commit (rank 1 writes the step itself if none comes by ``deadline - lead``: ``failover.py``).

        Not inside ``step()``: the user's ``scheduler.step()`` (and any post-step update) comes after it
        in the loop, and a checkpoint written here resumed one scheduler step behind. Every group takes the
        loaders and RNG now (as the hook does at a step); the writer writes, the others wait, at the first
        training forward after the step (``_on_forward``), at ``iteration_start()`` or at ``close()``."""
        rank = self.manager.participating_rank()
        self._log.info(ALL_LEAVING, step=step, notice_id=notice.id, replica_rank=rank)
        self.manager.shutdown(wait=False)
        self._replica_rank = rank
        self._pending = (notice, step, Snapshot.take(self.hook._objs.loaders))
        if not self._starts_seen:
            self._log.warning("replica_write_at_step", step=step,
                              why="this loop never called guard.iteration_start(): the checkpoint is written "
                                  "now, before the loop's post-step work (scheduler.step()) of this step",
                              fix="use guard.optimizer(opt), or call guard.iteration_start() before each "
                                  "manager.start_quorum()")
            self._write_pending()

    def iteration_start(self) -> None:
        """The start of an iteration, for a loop driving ``vote()``/``after_step()`` itself: call it before the
        next ``manager.start_quorum()``. A whole-job leave decided at the last step writes its emergency
        checkpoint here and raises ``Preempted``."""
        self._starts_seen = True
        self._commit_gate.armed = False  # a vote of an iteration given up (an exception before should_commit)
        with self._lock:
            if not self._fallback_on:
                self._phase = "iter"
        self._write_pending()

    def _write_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                self._over.set()
                self._done.set()
        if pending is not None:
            notice, step, snap = pending
            if step is None:  # a deferred deadline fallback: the last committed step, read now
                self.hook.emergency_exit(notice, self.manager.current_step(), self._snap_of_last_step())
            lead = fallback_lead(max(0.0, (notice.deadline - notice.received_at).total_seconds()))
            if self._replica_rank > 0 or notice.seconds_left() <= lead:  # a late writer: the failover may write
                await_writer(self, notice, step, lead)  # returns only when this group must write
            write_step(self, notice, step, snap)  # leaves committed if another group committed the step meanwhile

    def _on_forward(self, module: Any, args: Any) -> None:
        """A training forward (the core hook's anchor rule: not a forward under no_grad in eval mode, which a
        validation after the step is, before a ``ReduceLROnPlateau.step(val)``): the loop's post-step work of
        the last committed step is over. A whole-job leave (or a deferred deadline fallback) writes here."""
        if not module.training and not torch.is_grad_enabled():
            return
        with self._lock:
            if not self._fallback_on:
                self._phase = "iter"
        if self._pending is not None:
            self._write_pending()

    # ---------------------------------------------------------- deadline fallback

    def _gate(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: note the step; once the fallback writes from its thread, hold it (the state
        of the last committed step must not move under the write; the process leaves from the watchdog)."""
        if threading.current_thread() is self._watchdog:
            return  # DCP's fake step on an optimizer with no state yet, inside the fallback's own save
        # LocalSGD/DiLoCo entered after the guard: refused by _any_optimizer_step, a global pre-hook torch runs
        # before this one
        with self._lock:
            if not self._fallback_on:
                self._phase = "stepping"
                return
        self._halt.wait()  # set only when a group fallback is called off (GroupFallback.run)

    def _any_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook (every optimizer of the process, before its own hooks): LocalSGD/
        DiLoCo on this manager, on whatever optimizer, is refused at its first inner step."""
        if self.hook._life.closed or threading.current_thread() is self._watchdog:
            return
        found = self._step_check(optimizer)
        if found is not None:
            self._refuse(found)

    def _snap_of_last_step(self) -> Optional[Snapshot]:
        """Loaders and RNG as right after the last optimizer step (the hook takes them at its post-hook)."""
        return self.hook._state_at.snap

    def _deadline_watch(self, notice: Notice) -> None:
        """Watchdog (one per noticed group): leave by ``deadline - fallback_lead``, or write here."""
        lead = fallback_lead(notice.seconds_left())
        if self._done.wait(max(0.0, notice.seconds_left() - lead)) or self.hook._life.closing():
            return  # left, written, or the hook is over (a process that caught Preempted goes on: a test, a REPL)
        try:
            self._fallback(notice)
        except Exception as exc:  # noqa: BLE001 - never let the watchdog die silently
            self._log.error(FALLBACK_MISSED, notice_id=notice.id, why=f"fallback failed: {exc!r}")

    def _fallback(self, notice: Notice) -> None:
        with self._lock:
            if self._done.is_set() or self._over.is_set() or self.hook._life.closing():
                return
            single = self.hook._group is None
            direct = self._phase == "iter" and single
            # the step the state is at: the hook's count (after_step's committed step, a resume's, a heal's) —
            # not the manager's, which should_commit() counts before the optimizer steps (held from here on)
            step = self.hook._steps.count if direct else self.manager.current_step()
            if direct:
                self._fallback_on = True  # from here every optimizer step of this process is held
                self._over.set()
                self._done.set()
            elif single and self._pending is None:
                self._pending = (notice, None, None)  # the loop's next training forward writes it
        group_fb = not single and self._group_fb is not None and self._group_fb.available
        where = "watchdog" if direct else "next-training-forward" if single else "group-trigger" if group_fb else "none"
        self._log.warning(FALLBACK, notice_id=notice.id, step=step, seconds_left=round(notice.seconds_left(), 3),
                          where=where, why="this group has not left by deadline - lead (no committed step since the "
                                           "notice: the other groups left, the quorum or the lighthouse stalls)")
        if direct:
            self.hook._internal = True  # the training thread's hook points stand still meanwhile
            if self.hook._standing(step)[0]:
                # nothing trained, nothing resumed: no state to keep (a step-0 checkpoint would hold the RNG and
                # loaders of the moment, mid-iteration, and resume otherwise than a fresh start)
                self.hook._exit_from_background(notice, None, step)
                return
            _BG.on = True  # this thread: no DCP fake step() on a stateless optimizer (SGD) under the training thread
            result = self.hook._save(notice, "emergency", self._snap_of_last_step())
            self.hook._exit_from_background(notice, result, step)
            return
        if group_fb:
            assert self._group_fb is not None
            try:
                self._group_fb.trigger(notice)  # every rank's listener writes its part (group_fallback.py)
            except Exception as exc:  # noqa: BLE001 - the bounded exit below still stands
                self._log.error(FALLBACK_MISSED, notice_id=notice.id, why=f"group trigger failed: {exc!r}")
        if not single:
            why = ("the group's ranks could not write together (one in post-step work, steps differ, or no "
                   "torchrun store)" if group_fb else "a replica group of several processes without torchrun's "
                                                     "store cannot write from one rank's watchdog")
        else:
            why = "the loop did not reach its next training forward (post-step work of the last committed step)"
        if self._over.wait(max(0.0, notice.seconds_left() - 0.5)):
            return  # the training thread writes (its commit is reported late if it lands past the deadline), or left
        with self._lock:
            if self._over.is_set():
                return
            pending, self._pending = self._pending, None
            self._done.set()
        # a non-writer whose loop never came back: done if this leave's commit is in storage
        if pending is not None and pending[1] is not None and self._replica_rank > 0 \
                and committed_at(self.hook._storage, pending[1], notice.received_at, self.hook._lineage):
            self._log.info(BY_PEER, notice_id=notice.id, step=pending[1], replica_rank=self._replica_rank)
            self.hook._hard_exit(notice, self._exit_code, pending[1], committed=True, nothing=False,
                                 by="replica-peer-commit")
        self._log.error(FALLBACK_MISSED, notice_id=notice.id, step=step, why=why + " before the deadline",
                        fix="the newest committed checkpoint stands; periodic checkpoints bound what is lost")
        self.hook._hard_exit(notice, EXIT_SAVE_FAILED, step, committed=False, nothing=False, by="replica-deadline")

    def close(self) -> None:
        """A loop that ended right after a whole-job leave still writes its checkpoint (then ``Preempted``)."""
        try:
            self._write_pending()
        finally:
            self._done.set()
            for h in self._fwd_handles + self._gate_handles:
                h.remove()
            self._fwd_handles, self._gate_handles = [], []
            self._any_step.remove()
            self._commit_gate.release(self._unvoted)
            self.hook.close()


class GuardedOptimizer(torch.optim.Optimizer):
    """torchft's ``OptimizerWrapper`` plus the leave vote: ``zero_grad`` starts the quorum, ``step`` commits.

    An ``Optimizer`` as torchft's wrapper is (issue 25): an LR scheduler can be built on it
    (``LambdaLR(guard.optimizer(opt), ...)``); parameter groups and state are the wrapped
    optimizer's own objects, so either one may be given to the scheduler and the hook's dict.
    ``Optimizer.__init__`` is not run (no parameters of its own; torchft's wrapper does the same).
    """

    def __init__(self, guard: ReplicaGuard, optim: torch.optim.Optimizer) -> None:  # noqa: D107
        self.guard = guard
        self.optim = optim

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optim.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        g = self.guard
        g._starts_seen = True
        g._commit_gate.armed = False  # a vote of an iteration given up carries no later should_commit()
        if g._pending is not None:
            # the whole job leaves (the manager is shut down): no quorum; the checkpoint is written at the
            # first training forward (a loop may call zero_grad() before its scheduler.step()), else here when
            # the dict has no model to watch
            if not g._fwd_handles:
                g._write_pending()
            self.optim.zero_grad(set_to_none)
            return
        g.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """Vote, ``should_commit``, step the wrapped optimizer if committed; may raise ``Preempted``."""
        if closure is not None:
            raise TypeError("GuardedOptimizer.step() takes no closure (torchft commits a step after the backward)")
        self.guard.vote()
        committed = bool(self.guard.manager.should_commit())
        if committed:
            self.optim.step()
        self.guard.after_step(committed)
        return committed

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optim.load_state_dict(sd)
