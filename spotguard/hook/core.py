"""The plain-PyTorch hook: notice -> agreed step -> committed DCP checkpoint -> clean exit.

Where the code lives (docs/architecture.md, "spotguard/hook/"): the state has
owners — ``clock.py`` (``StepClock``: count, in-step, a round's hold; every part
reaches it as ``self._steps``), ``handover.py`` (``StateAtS``: what the two
threads hand each other, as ``self._state_at``), ``lifecycle.py`` (``Lifecycle``:
closed, torn down, leaving, the exit's code and decision, as ``self._life``), ``cycle.py`` (``ImplicitCycle``),
``stepcopy.py`` (``StepCopies``), ``loopshape.py`` (``LoopShape``: the loop's shape, as ``self._loop``),
``stepbook.py`` (``StepBook``: the step hooks' bookkeeping, as ``self._book``) — with ``stateat.py`` (the
state at S) — and the rest is one mixin per seam, each
readable alone: ``stephooks.py`` (optimizer/forward hooks), ``boundary.py``
(iteration boundaries), ``notices.py`` (intake, signals, the local level),
``agreement.py`` (a round's decision, acting on it) with ``rounds.py`` (the
agreement thread), ``save.py`` (the DCP write and commit protocol),
``staged.py`` (the staged background save), ``resume.py`` (loading the newest
committed checkpoint), ``exit.py`` (teardown, exit codes, ``Preempted``,
leaving from the background), ``settings.py`` (tunables). This module keeps
construction and the public API.

Two ways to act on a notice:

- **At any moment** (one optimizer; under ``torch.distributed`` or in a single
  process, whose rounds need no collective; implicit loops, and ``hook.range()`` /
  ``hook.step()`` loops whose boundaries prove one optimizer step per iteration;
  agreement.py): the step hooks only keep ``_steps.count`` / ``_steps.in_step``
  under ``_steps.cv`` and snapshot RNG/loader/buffers at the post-hook; an agreement
  thread per rank decides S and writes the checkpoint; the pre-hook holds a step
  only while a round runs and until the tensors of S are copied (``_step_begin``).
  Several optimizers in ``hook.range()``/``hook.step()`` loops: the boundary counts
  the iteration and checks every optimizer stepped as often as in the first one;
  ``_steps.in_step`` spans the iteration's first optimizer step that took no copy of what it
  changes (``stepcopy.py``: the last one, normally) to its boundary, and every
  optimizer's pre-hook holds (``_multi_step_begin``).
- **At the step boundary** (adapters, several optimizers in an implicit loop or with
  a GradScaler, explicit loops whose optimizer steps do not map onto iterations,
  ``SPOTGUARD_BACKGROUND_AGREEMENT=0``), below. Which one a process uses is logged
  once per loop kind (``notice_path``).

Shape of one iteration with no loop change, boundary path (see docs/api.md)::

    fwd/bwd ... [pre-hook: BOUNDARY] opt.step() [post-hook: DECIDE] sched.step() ...

- DECIDE (post-hook of the clock optimizer, or ``GradScaler.update()`` when a
  scaler is in the dict, because the scaler skips ``step()`` on inf/nan): count
  the iteration, snapshot RNG / loader / running-stat buffers (they move on
  before the next step), launch a non-blocking MAX all-reduce of the local
  flag on the hook's own gloo group.
- BOUNDARY (pre-hook of the clock's next step): wait that reduction (finished
  long ago) and, if any rank asked, write the checkpoint standing for the end
  of the deciding iteration: model/optimizer/scheduler as they are now (the
  scheduler has stepped), RNG/loader/buffers from the snapshot.

The clock is the first optimizer that steps (learned at run time), so a GAN's
two optimizers work whatever their order in the dict. ``hook.range(total)`` and
``hook.step()`` replace the optimizer hooks by an explicit boundary.

Levels carried by the flag (MAX wins): 0 nothing, 1 ordinary checkpoint
(rebalance/maintenance notice), 2 emergency (preemption/termination, SIGTERM,
SIGUSR1), 3 a notice whose id is already in the newest committed checkpoint
(a daemon replay after restart: exit without training or saving again).

After ``dist.destroy_process_group()`` no collective is possible: a notice that
arrives then (or after the last step) is logged as ``notice_after_last_step``
and the process keeps its own exit code (0 for a finished job). The hook wraps
``destroy_process_group`` (once per process) so that it first waits, bounded,
for the flag reduction launched at the last iteration's end and for a periodic
upload, then drops its own gloo groups: tearing groups down under in-flight
gloo work could abort a rank ("terminate called without an active exception").

Failed saves: DCP reports write errors as ``CheckpointException``, a
``BaseException``; ``_save`` catches it (re-raising only KeyboardInterrupt and
SystemExit), reports ``checkpoint_failed`` and leaves the previous commit alone.
Storage requests of a notice-driven save run inside
``storage.deadline_at(deadline - SAVE_MARGIN)`` (see ``SAVE_MARGIN``).

Periodic checkpoints (``every`` seconds; ``spotguard.hook.periodic``): the flag
reduction also carries (due, busy) votes; when some rank says due and none says
busy, every rank stages a CPU copy of the state at the boundary and uploads it
on a background thread over a dedicated gloo group, committed with reason
``periodic``. A notice during such an upload: finish it if its own throughput
says it ends within half the time left (cut off there), else abort it; then the
notice's checkpoint is written (docs/storage.md).
"""

from __future__ import annotations

import atexit
import builtins
import os
import signal
import threading
import uuid
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from ..history.writer import for_hook as history_for_hook
from ..history.writer import tap as history_tap
from ..logs import get_logger
from ..notice import Notice
from ..storage import Storage, StorageError, open_storage
from ..timefmt import utcnow
from . import events as ev
from .agreement import AgreementMixin, BackgroundAgreement, LocalAgreement
from .boundary import BoundaryMixin
from .clock import StepClock, step_of
from .dist import (
    Agreement,
    guard_destroy,
    is_dist,
    make_group,
    unguard_destroy,
)
from .exit import ExitMixin, Preempted
from .handover import StateAtS
from .loopshape import LoopShape
from .lifecycle import Lifecycle
from .notices import NoticesMixin
from .periodic import PeriodicSaver
from .preflight import check_launcher, probe_writable, unwritable_message
from .peers import stop_watch, watch_peers  # peer-liveness watch (#14 item 3)
from .resume import ResumeMixin
from .save import SaveMixin, _skip_fake_step_in_background
from .settings import (  # noqa: F401 - re-exported: adapters, torchft and tests import them from core
    EMERGENCY_LEAD,
    EXIT_SAVE_FAILED,
    HOLD_SLACK,
    LEVEL_CHECKPOINT,
    LEVEL_EMERGENCY,
    LEVEL_NONE,
    LEVEL_REPLAY,
    PERIODIC_NOTICE_PREFIX,
    PERIODIC_SYNC_TIMEOUT,
    QUIESCE_AGREEMENT_TIMEOUT,
    QUIESCE_PERIODIC_TIMEOUT,
    SAVE_MARGIN,
    SIGNAL_GRACE,
    _env_float,
)
from .state import Objects, Snapshot, classify, tracked_buffers
from .stepbook import StepBook
from .stepcopy import StepCopies
from .stephooks import StepHooksMixin
from .watch import StateWatch

__all__ = ["Hook", "Preempted", "SIGNAL_GRACE", "EMERGENCY_LEAD", "EXIT_SAVE_FAILED"]


def periodic_notice(step: int) -> Notice:
    """The synthetic notice an adapter's ``every=`` checkpoint is written under (never sent anywhere)."""
    now = utcnow()
    return Notice(id=f"{PERIODIC_NOTICE_PREFIX}{step}", source="signal", kind="maintenance",
                  deadline=now + timedelta(seconds=PERIODIC_SYNC_TIMEOUT), received_at=now,
                  detail="every= safety-net checkpoint")


class Hook(StepHooksMixin, BoundaryMixin, NoticesMixin, AgreementMixin, SaveMixin, ResumeMixin,
           ExitMixin):
    """Emergency checkpointing for a dict of stateful objects (see the module docstring)."""

    # A dict hook under a launcher must come after init_process_group; framework adapters
    # arm later, once their trainer has created the group.
    _launcher_check = True
    # Notices agreed off the training thread and saved in the background (agreement.py); adapters
    # whose framework writes the checkpoint itself keep the step-boundary path.
    _background_capable = True
    # a loop that skips optimizer.step() gets optimizer_step_skipped; an engine that owns the count does not
    _warn_skipped_steps = True

    def __init__(
        self,
        state: Mapping[str, Any],
        storage: str | Storage | None = None,
        *,
        socket: str | None = None,
        keep: int | None = None,
        exit_code: int = 143,
        on_notice: Callable[[Notice], Any] | None = None,
        signals: bool = True,
        intake: bool = True,
        every: float | None = None,
        scope: Mapping[str, str] | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an integer in 0..255, got {exit_code!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0):
            raise ValueError(f"every must be a positive number of seconds or None, got {every!r}")
        if self._launcher_check:
            check_launcher(dist.is_available() and dist.is_initialized())
        self._objs: Objects = classify(state, scope)
        self._storage: Storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self._keep = keep
        self._life = Lifecycle(exit_code, self.__dict__.get("_life"))  # closed, torn down, leaving (lifecycle.py)
        self._on_notice_cb = on_notice
        self._dist = is_dist()
        self._rank = dist.get_rank() if self._dist else 0
        self._world = dist.get_world_size() if self._dist else 1
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._group = make_group() if self._dist else None
        self._agree = Agreement(self._group)
        # the job history beside the checkpoints (spotguard/history): a tap on this logger, written off-thread
        self._history = history_for_hook(self._storage, self._rank, self._local_rank,
                                         lambda: step_of(self))
        self._log = history_tap(get_logger("spotguard.hook", component="hook", rank=self._rank), self._history)
        if not getattr(self, "_probed", False):
            self._probe_storage()
        # periodic safety-net checkpoints: their own gloo group, created here (collective, every rank)
        self._periodic: Optional[PeriodicSaver] = PeriodicSaver(self, float(every)) if every is not None else None
        if self._dist:
            guard_destroy(self._quiesce)
        # peer-liveness watch: its own gloo group + threads (collective, every rank, right here)
        self._peers = watch_peers(self) if self._dist else None

        self._steps = StepClock()  # the count, the in-step flag, a round's hold (clock.py)
        self._state_at = StateAtS(self._steps.cv)  # the state at S the two threads hand over (handover.py)
        self._resumed = False
        self._resumed_step = 0
        self._resumed_dir: Optional[str] = None  # the committed folder this run's state came from
        # Which run wrote a checkpoint (COMMIT.json extra "lineage"): inherited on resume, so a second run
        # on the same storage that never resumed cannot pass another run's checkpoint off as its own.
        self._lineage = uuid.uuid4().hex
        self._internal = False
        self._buffers = {k: tracked_buffers(m) for k, m in self._objs.models.items()}
        self._buffers = {k: b for k, b in self._buffers.items() if b}
        # Version marks behind the exact any-moment path (watch.py); its ``tracked`` buffers are the snapshot's.
        _skip_fake_step_in_background()  # DCP's fake step: never off the training thread, never a SAM wrapper's
        self._watch = StateWatch(self._objs.models, self._buffers)
        self._buffers = self._watch.tracked
        self._baseline = self._watch.baseline()  # "did anything train?" when no optimizer step was ever seen
        self._book = StepBook(self._objs.scalers, self._objs.models)  # the step hooks' bookkeeping (stepbook.py)
        self._loop = LoopShape(self._objs.optimizers, self._iterations_unproven)  # the loop seen (loopshape.py)
        self._step_copies = StepCopies()  # what an optimizer's first step of an iteration overwrites (stepcopy.py)

        self._lock = threading.Lock()
        self._pending: dict[str, Notice] = {}
        self._seen: set[str] = set()
        self._committed_ids: set[str] = set()
        self._doomed: Optional[frozenset[int]] = None  # ranks with a notice, from the last agreement (doomed.py)
        self._evac: Any = None  # this save's evacuation role (evacuate.py), while it runs
        self._write_rate: Optional[float] = None  # bytes/s of this rank's last big write (evacuate.py predicts with it)

        self._test_delay = _env_float("SPOTGUARD_TEST_SAVE_DELAY")
        delay_rank = os.environ.get("SPOTGUARD_TEST_SAVE_DELAY_RANK")
        if delay_rank not in (None, "") and int(delay_rank) != self._rank:
            self._test_delay = None

        # The background agreement (agreement.py): its thread and gloo group exist on every rank of an
        # eligible hook; ``_bg_on`` (notices wake it) once training is seen in implicit mode.
        self._ordinary_cancel = threading.Event()  # set: the ordinary background save in flight gives up
        self._round_action: Optional[str] = None  # what the running background round does ("checkpoint"...)
        self._notice_saving: Optional[int] = None  # the step a notice's save is writing (save.py; periodic waits)
        self._bg_on = False
        self._bg_ready = threading.Event()  # resume() is over (or training started without it)
        self._bg: Optional[BackgroundAgreement] = None
        self._loop.boundary_why = self._why_not_background()
        if self._loop.boundary_why is None:
            # Under torch.distributed: a thread + gloo group + the c10d store; a single process: the same rounds
            # with no collective at all (never an init_process_group on the user's behalf).
            self._bg = BackgroundAgreement(self) if self._dist else LocalAgreement(self)
            self._bg.start()

        self._install_step_hooks()
        if signals:
            self._install_signals()
        self._intake: Any = None
        self._socket = socket
        if intake:
            self._start_intake(socket)
        atexit.register(self._at_exit)
        self._log.info(
            ev.HOOK_INSTALLED, world_size=self._world, storage=self._storage.uri, pid=os.getpid(),
            objects=self._objs.roles(), socket=getattr(self._intake, "socket_path", None),
        )
        if self._loop.boundary_why is not None:
            self._log_path("boundary", "any", self._loop.boundary_why)

    def _why_not_background(self) -> Optional[str]:
        """None when notices can be acted on at any moment (one optimizer: its step hooks are the clock);
        otherwise why this hook acts at iteration boundaries (said once in the ``notice_path`` line)."""
        if not self._background_capable:
            return "the framework writes the checkpoint itself, at its own step boundary"
        if os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT", "1").strip() == "0":
            return "SPOTGUARD_BACKGROUND_AGREEMENT=0"
        n = len(self._objs.optimizers)
        if n == 0:
            return "no optimizer in the dict: no optimizer step shows where an iteration ends"
        if n > 1 and self._book.scaler is not None:
            return (f"{n} optimizers and a GradScaler: the scaler's update() is no iteration's end the step "
                    "hooks can prove, so the state of an iteration's end is known only at the boundary")
        return None

    def _implicit_why(self) -> Optional[str]:
        """Why an implicit loop (no ``hook.range()``/``hook.step()``) of this hook acts at boundaries, or None.
        Several optimizers: only an explicit loop's boundaries prove which optimizer step ends an iteration."""
        n = len(self._objs.optimizers)
        if n > 1:
            return (f"{n} optimizers (a GAN's D and G steps): which optimizer step ends an iteration cannot be "
                    "proven from the step hooks of an implicit loop, so the state of an iteration's end is known "
                    "only at the boundary (hook.range()/hook.step() loops act at any moment)")
        return None

    def _log_path(self, path: str, loop: str, why: str) -> None:
        """Once per (path, loop): which way this process acts on a notice, and why (``notice_path``)."""
        if (path, loop) in self._loop.path_logged:
            return
        self._loop.path_logged.add((path, loop))
        log = self._log.info if path == "any-moment" or loop == "any" else self._log.warning
        log(ev.NOTICE_PATH, path=path, loop=loop, why=why, world_size=self._world)

    def _probe_storage(self) -> None:
        """Every rank writes and deletes a small object; any failure is one StorageError on every rank."""
        err = probe_writable(self._storage)
        if self._dist:
            allv: list[Any] = [None] * self._world
            dist.all_gather_object(allv, err, group=self._group)
        else:
            allv = [err]
        errors = [(r, e) for r, e in enumerate(allv) if e]
        if errors:
            raise StorageError(unwritable_message(self._storage.uri, errors))
        self._probed = True

    # ------------------------------------------------------------------ public

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def iteration(self) -> int:
        """Completed iterations (the step a checkpoint taken now would resume from)."""
        return self._steps.count

    def range(self, total: int) -> Iterator[int]:
        """``for step in hook.range(total):`` resumes, then yields steps; each iteration's end is a boundary."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative integer, got {total!r}")
        self._loop.explicit_intent = True  # resume() must not arm the background agreement (hook.range does, below)
        if not self._resumed:
            self.resume()
        self._begin_explicit("hook.range()", self._steps.count)
        for i in builtins.range(self._steps.count, total):
            yield i
            if self._loop.range_clock:
                self._clocked_boundary(final=(i == total - 1))
            else:
                self._steps.advance()
                self._explicit_boundary(final=(i == total - 1))

    def step(self) -> int:
        """An explicit iteration boundary (call once at the end of each iteration); returns completed iterations."""
        if not self._loop.explicit and not self._loop.range_clock:
            self._loop.explicit_intent = True
            # the loop started at the resumed step (0 without a resume): one optimizer step since then proves
            # the first boundary; anything else hands this loop to the boundary path
            self._begin_explicit("hook.step()", self._resumed_step)
        if self._loop.range_clock:
            self._clocked_boundary(final=False)
            return self._steps.count
        if not self._loop.take_implicit():  # else this iteration was already counted by the optimizer post-hook
            self._steps.advance()
        self._explicit_boundary(final=False)
        return self._steps.count

    def notify(self, notice: Notice) -> None:
        """Hand the hook a notice yourself (tests, custom sources); same path as the daemon's."""
        self._receive(notice, via="api")

    def close(self) -> None:
        """Remove the optimizer hooks, restore signal handlers, stop the intake (idempotent)."""
        if not self._life.close():
            return
        stop_watch(getattr(self, "_peers", None))  # bye to the peers before anything goes
        if getattr(self, "_watch", None) is not None:
            self._watch.close()  # Parameter.data back to torch's own (when no other hook watches)
        self._bg_on = False
        if self._bg is not None:
            self._bg.close(0.0)
        unguard_destroy(self._quiesce)
        if self._periodic is not None and not self._life.exiting:
            self._periodic.quiesce(QUIESCE_PERIODIC_TIMEOUT)  # let an in-flight upload finish (bounded)
        self._remove_step_hooks()
        for sig, prev in self._life.signal_handlers().items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._life.forget_handlers()
        if self._intake is not None:
            self._intake.close()
        try:
            atexit.unregister(self._at_exit)
        except Exception:
            pass
        if self._history is not None:
            self._history.close()  # this attempt ends at the close (the process may train again)
