"""The plain-PyTorch hook: notice -> agreed step -> committed DCP checkpoint -> clean exit.

Where the code lives (``Hook`` is this class plus one mixin per seam, each
readable alone): ``notices.py`` (intake, signals, the local level),
``agreement.py`` (the agreement: background rounds, or at the boundary; acting
on it), ``save.py`` (the DCP write and commit protocol, the staged background
save), ``resume.py`` (loading the newest committed checkpoint), ``exit.py``
(teardown, exit codes, ``Preempted``, leaving from the background),
``settings.py`` (tunables). This module keeps construction, the public API and
the optimizer step hooks.

Two ways to act on a notice:

- **At any moment** (one optimizer; under ``torch.distributed`` or in a single
  process, whose rounds need no collective; implicit loops, and ``hook.range()`` /
  ``hook.step()`` loops whose boundaries prove one optimizer step per iteration;
  agreement.py): the step hooks only keep ``_count`` / ``_in_step``
  under ``_cv`` and snapshot RNG/loader/buffers at the post-hook; an agreement
  thread per rank decides S and writes the checkpoint; the pre-hook holds a step
  only while a round runs and until the tensors of S are copied (``_step_begin``).
  Several optimizers in ``hook.range()``/``hook.step()`` loops: the boundary counts
  the iteration and checks every optimizer stepped as often as in the first one;
  ``_in_step`` spans the iteration's first optimizer step to its boundary, and every
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
import time
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
from .agreement import AgreementMixin, BackgroundAgreement, LocalAgreement, agreed_notice
from .clock import ClockNames, StepClock
from .cycle import ImplicitCycle
from .dist import (
    NO_DEADLINE_MS,
    Agreement,
    guard_destroy,
    is_dist,
    make_group,
    unguard_destroy,
)
from .exit import ExitMixin, Preempted
from .notices import NoticesMixin
from .periodic import PeriodicSaver
from .preflight import check_launcher, probe_writable, unwritable_message
from .peers import stop_watch, watch_peers  # peer-liveness watch (#14 item 3)
from .resume import ResumeMixin
from .save import SaveMixin, _Result, _skip_fake_step_in_background
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
from .state import Objects, Snapshot, classify, clone_buffers, tracked_buffers
from .watch import StateWatch

__all__ = ["Hook", "Preempted", "SIGNAL_GRACE", "EMERGENCY_LEAD", "EXIT_SAVE_FAILED"]


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Never traced by torch.compile (a module hook inside a compiled region would be, with guards on the
    hook's counters: a recompilation every step)."""
    try:
        return torch._dynamo.disable(fn)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - torch without dynamo
        return fn


def periodic_notice(step: int) -> Notice:
    """The synthetic notice an adapter's ``every=`` checkpoint is written under (never sent anywhere)."""
    now = utcnow()
    return Notice(id=f"{PERIODIC_NOTICE_PREFIX}{step}", source="signal", kind="maintenance",
                  deadline=now + timedelta(seconds=PERIODIC_SYNC_TIMEOUT), received_at=now,
                  detail="every= safety-net checkpoint")


class Hook(ClockNames, NoticesMixin, AgreementMixin, SaveMixin, ResumeMixin, ExitMixin):
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
        self._exit_code = exit_code
        self._on_notice_cb = on_notice
        self._dist = is_dist()
        self._rank = dist.get_rank() if self._dist else 0
        self._world = dist.get_world_size() if self._dist else 1
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._group = make_group() if self._dist else None
        self._agree = Agreement(self._group)
        # the job history beside the checkpoints (spotguard/history): a tap on this logger, written off-thread
        self._history = history_for_hook(self._storage, self._rank, self._local_rank,
                                         lambda: getattr(self, "_count", None))
        self._log = history_tap(get_logger("spotguard.hook", component="hook", rank=self._rank), self._history)
        if not getattr(self, "_probed", False):
            self._probe_storage()
        self._torn_down = False  # the user destroyed the process group (or the hook quiesced for exit)
        self._late: Optional[tuple[int, int]] = None  # the last flag reduction, settled at teardown
        # periodic safety-net checkpoints: their own gloo group, created here (collective, every rank)
        self._periodic: Optional[PeriodicSaver] = PeriodicSaver(self, float(every)) if every is not None else None
        if self._dist:
            guard_destroy(self._quiesce)
        # peer-liveness watch: its own gloo group + threads (collective, every rank, right here)
        self._peers = watch_peers(self) if self._dist else None

        self._steps = StepClock()  # the count, the in-step flag, a round's hold (clock.py; old names: ClockNames)
        self._resumed = False
        self._resumed_step = 0
        self._resumed_dir: Optional[str] = None  # the committed folder this run's state came from
        # Which run wrote a checkpoint (COMMIT.json extra "lineage"): inherited on resume, so a second run
        # on the same storage that never resumed cannot pass another run's checkpoint off as its own.
        self._lineage = uuid.uuid4().hex
        self._fresh_checked = False
        self._explicit = False
        self._implicit_counted = False
        self._internal = False
        self._closed = False
        self._exiting = False
        self._snap: Optional[Snapshot] = None
        self._clock: Optional[torch.optim.Optimizer] = None  # one optimizer: its steps (several: cycle.py)
        self._buffers = {k: tracked_buffers(m) for k, m in self._objs.models.items()}
        self._buffers = {k: b for k, b in self._buffers.items() if b}
        # Version marks behind the exact any-moment path (watch.py); its ``tracked`` buffers are the snapshot's.
        _skip_fake_step_in_background()  # DCP's fake step: never off the training thread, never a SAM wrapper's
        self._watch = StateWatch(self._objs.models, self._buffers)
        self._buffers = self._watch.tracked
        self._baseline = self._watch.baseline()  # "did anything train?" when no optimizer step was ever seen
        self._scaler = next(iter(self._objs.scalers.values()), None)
        self._many_opts = len(self._objs.optimizers) > 1
        # Several optimizers in an explicit loop: each one's steps since the last boundary, by its dict name (a
        # SAM wrapper's base counts for the wrapper), and the per-iteration counts the first boundary saw.
        self._opt_key: dict[int, str] = {}
        for name, opt in self._objs.optimizers.items():
            self._opt_key[id(opt)] = name
            base = getattr(opt, "base_optimizer", None)
            if isinstance(base, torch.optim.Optimizer):
                self._opt_key.setdefault(id(base), name)
        self._iter_steps: dict[str, int] = {}
        self._step_pattern: Optional[dict[str, int]] = None
        # several optimizers in an implicit loop (no hook.range()/hook.step()): where an iteration starts (cycle.py)
        self._cycle = ImplicitCycle(lambda o: self._opt_key.get(id(o), "?"), self._iterations_unproven)
        self._bwd_since_step = False  # a backward reached the clock's parameters since the last step
        self._train_fwd_seq = 0  # training forwards (train mode, grad enabled) so far
        self._last_fwd_training = False
        self._skip_warned = False

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
        # ``_cv`` (the clock's) also guards the handover of the state at S below, shared with that thread
        self._small: Optional[tuple[int, bytes, dict[str, Any], str]] = None
        self._snap_count = -1
        self._staged_step: Optional[int] = None
        self._exit_request: Optional[tuple[Notice, Any, Optional[int]]] = None
        # The model's first forward after step S (training or evaluation): the loop's work after the step
        # (scheduler, EMA update, scaler) is over, so the small state of S can be read (save.py).
        self._fwd_count = -1
        self._post_seq = 0  # optimizer post-hooks so far (any optimizer of the dict; the scaler's update)
        self._fwd_seq = 0  # _post_seq at the last forward that snapshotted the buffers
        self._fwd_bufs: Optional[tuple[int, dict[str, dict[str, torch.Tensor]]]] = None
        self._fwd_train_count = -1
        self._fwd_rng: Optional[tuple[int, torch.Tensor]] = None  # (count, torch RNG) at the first training forward
        self._realign: Optional[torch.Tensor] = None  # after a resume: the RNG the first training forward must see
        self._want_small: Optional[int] = None  # a round waits for the small state of this step
        self._want_state: Optional[int] = None  # a round needs the training thread's read of this step (fallback)
        self._want_copy = True  # ... as a copy (an ordinary checkpoint; an emergency reads the held live tensors)
        self._handoff: Optional[tuple[int, Any, int, str]] = None  # (step, state dict, bytes, error)
        self._step_event: Any = None  # CUDA: recorded on the training stream at each step's end
        self._exit_callbacks: list[Callable[[int, bool], Any]] = getattr(self, "_exit_callbacks", [])  # on_exit
        self._ordinary_cancel = threading.Event()  # set: the ordinary background save in flight gives up
        self._round_action: Optional[str] = None  # what the running background round does ("checkpoint"...)
        self._notice_saving: Optional[int] = None  # the step a notice's save is writing (save.py; periodic waits)
        self._cuda_params = any(p.is_cuda for m in self._objs.models.values() for p in m.parameters())
        self._explicit_intent = False
        self._bg_on = False
        self._bg_ready = threading.Event()  # resume() is over (or training started without it)
        self._bg: Optional[BackgroundAgreement] = None
        # An explicit loop (hook.range()/hook.step()) on the any-moment path: the optimizer clock counts, each
        # explicit boundary proves that it ended exactly one clock step (``_clocked_boundary``).
        self._range_clock = False
        self._confirmed = 0  # the count at the last boundary that proved "one clock step per iteration"
        self._range_broken: Optional[str] = None  # why that proof failed (the loop goes back to the boundary path)
        self._range_small: Any = None  # the small state read at the last proven boundary (``_capture_small``)
        self._path_logged: set[tuple[str, str]] = set()
        self._boundary_why = self._why_not_background()
        if self._boundary_why is None:
            # Under torch.distributed: a thread + gloo group + the c10d store; a single process: the same rounds
            # with no collective at all (never an init_process_group on the user's behalf).
            self._bg = BackgroundAgreement(self) if self._dist else LocalAgreement(self)
            self._bg.start()

        self._handles: list[Any] = []
        self._unwrap: list[tuple[Any, str]] = []  # instance attributes the hook set over methods
        self._scaler_orig: Optional[tuple[Any, Any]] = None
        self._install_step_hooks()
        self._prev_handlers: dict[int, Any] = {}
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
        if self._boundary_why is not None:
            self._log_path("boundary", "any", self._boundary_why)

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
        if n > 1 and self._scaler is not None:
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
        if (path, loop) in self._path_logged:
            return
        self._path_logged.add((path, loop))
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
        return self._count

    def range(self, total: int) -> Iterator[int]:
        """``for step in hook.range(total):`` resumes, then yields steps; each iteration's end is a boundary."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative integer, got {total!r}")
        self._explicit_intent = True  # resume() must not arm the background agreement (hook.range does, below)
        if not self._resumed:
            self.resume()
        self._begin_explicit("hook.range()", self._count)
        for i in builtins.range(self._count, total):
            yield i
            if self._range_clock:
                self._clocked_boundary(final=(i == total - 1))
            else:
                self._count += 1
                self._explicit_boundary(final=(i == total - 1))

    def step(self) -> int:
        """An explicit iteration boundary (call once at the end of each iteration); returns completed iterations."""
        if not self._explicit and not self._range_clock:
            self._explicit_intent = True
            # the loop started at the resumed step (0 without a resume): one optimizer step since then proves
            # the first boundary; anything else hands this loop to the boundary path
            self._begin_explicit("hook.step()", self._resumed_step)
        if self._range_clock:
            self._clocked_boundary(final=False)
            return self._count
        skip = self._implicit_counted  # this iteration was already counted by the optimizer post-hook
        self._implicit_counted = False
        if not skip:
            self._count += 1
        self._explicit_boundary(final=False)
        return self._count

    def notify(self, notice: Notice) -> None:
        """Hand the hook a notice yourself (tests, custom sources); same path as the daemon's."""
        self._receive(notice, via="api")

    def close(self) -> None:
        """Remove the optimizer hooks, restore signal handlers, stop the intake (idempotent)."""
        if self._closed:
            return
        self._closed = True
        stop_watch(getattr(self, "_peers", None))  # bye to the peers before anything goes
        if getattr(self, "_watch", None) is not None:
            self._watch.close()  # Parameter.data back to torch's own (when no other hook watches)
        self._bg_on = False
        if self._bg is not None:
            self._bg.close(0.0)
        unguard_destroy(self._quiesce)
        if self._periodic is not None and not self._exiting:
            self._periodic.quiesce(QUIESCE_PERIODIC_TIMEOUT)  # let an in-flight upload finish (bounded)
        self._remove_step_hooks()
        for sig, prev in self._prev_handlers.items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._prev_handlers.clear()
        if self._intake is not None:
            self._intake.close()
        try:
            atexit.unregister(self._at_exit)
        except Exception:
            pass
        if self._history is not None:
            self._history.close()  # this attempt ends at the close (the process may train again)

    # ------------------------------------------------------------- step hooks

    def _install_step_hooks(self) -> None:
        for m in self._objs.models.values():  # and the module a wrapper holds (DDP .module, compile's _orig_mod)
            # (not a compiled module's _orig_mod: dynamo would trace the hook and guard on the hook's counters)
            for mod in {id(x): x for x in (m, getattr(m, "module", None)) if isinstance(x, torch.nn.Module)}.values():
                self._handles.append(mod.register_forward_pre_hook(_eager(self._on_forward)))
        opts = list(self._objs.optimizers.values())
        for opt in list(opts):  # SAM-style wrappers step their base optimizer from first/second_step()
            base = getattr(opt, "base_optimizer", None)
            if isinstance(base, torch.optim.Optimizer) and all(base is not o for o in opts):
                opts.append(base)
                if callable(getattr(opt, "first_step", None)):
                    self._wrap_first_step(opt, base)
        for opt in opts:
            self._handles.append(opt.register_step_pre_hook(self._pre_hook))
            self._handles.append(opt.register_step_post_hook(self._post_hook))
        if len(opts) == 1 and self._warn_skipped_steps:
            self._watch_skipped_steps(opts[0])
        sc = self._scaler
        if sc is not None:
            orig_step, orig_update = sc.step, sc.update
            hook = self

            stepped: list[Any] = []  # the optimizers given to step() since the last update(), in order

            def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                if not (hook._internal or hook._explicit or hook._closed):
                    if hook._many_opts:
                        stepped.append(optimizer)
                        if not hook._cycle.begins(optimizer, hook._count):
                            return orig_step(optimizer, *args, **kwargs)  # inside an iteration (n_critic, G)
                    if hook._bg_on:
                        hook._step_begin()
                    if hook._agree.pending:
                        hook._boundary()
                return orig_step(optimizer, *args, **kwargs)

            def update(*args: Any, **kwargs: Any) -> Any:
                out = orig_update(*args, **kwargs)
                if not (hook._internal or hook._explicit or hook._closed):
                    hook._post_seq += 1
                    done = stepped[:]
                    stepped.clear()
                    # several optimizers: the implicit cycle rule over the steps this update() closes (an AMP
                    # WGAN must update() after each D step: a second step(opt_d) before it raises), so each
                    # update() is no iteration of its own
                    ends = [hook._cycle_end(o) for o in done] if hook._many_opts else [True]
                    if any(ends):
                        hook._decide()
                return out

            sc.step, sc.update = step, update
            self._scaler_orig = (orig_step, orig_update)

    def _watch_skipped_steps(self, opt: torch.optim.Optimizer) -> None:
        """Say so when the loop skips ``optimizer.step()`` (a NaN guard: backward, no step, ``zero_grad()``):
        the implicit clock counts optimizer steps, so ``hook.resume()`` would return fewer than the loop's
        iterations and ``range(start, total)`` would train some batches twice. Seen in the next backward:
        gradients the last backward left are gone (``None``) and no step came in between. One optimizer only
        (a GAN's generator legitimately loses the gradients the discriminator's loss gave it)."""
        first = next((p for g in opt.param_groups for p in g["params"]
                      if isinstance(p, torch.Tensor) and p.requires_grad), None)
        if first is None:
            return
        hook = self
        was_none = [False]
        # (training forwards counted at the last backward, was that backward's forward a training one): a
        # backward counts only when a training forward came since the last one and that one was training too —
        # PCGrad's per-task backwards share one forward, a saliency pass runs in eval mode (review 3)
        last = [-1, False]

        def before_grad(grad: torch.Tensor) -> None:
            # every gradient computed for ``first``: ``torch.autograd.grad`` too, which leaves ``.grad`` alone
            was_none[0] = first.grad is None

        def on_grad(param: torch.Tensor) -> None:
            # a backward's accumulation into ``.grad`` only (register_post_accumulate_grad_hook): an
            # ``autograd.grad`` over the parameters (a gradient-norm penalty) is no backward whose gradients a
            # zero_grad could discard; explicit loops (hook.range()/hook.step()) count iterations themselves
            fresh, prev_training = hook._train_fwd_seq != last[0], last[1]
            last[0], last[1] = hook._train_fwd_seq, hook._last_fwd_training
            if hook._bwd_since_step and was_none[0] and fresh and prev_training and not hook._skip_warned \
                    and not hook._explicit and not hook._range_clock and not hook._explicit_intent \
                    and not hook._internal and hook._scaler is None:
                hook._skip_warned = True
                hook._log.warning(ev.OPTIMIZER_STEP_SKIPPED, step=hook._count,
                                  why="gradients of a backward were discarded (zero_grad) without an "
                                      "optimizer.step(): hook.resume() counts optimizer steps, not your loop's "
                                      "iterations, so a resumed range(start, total) would train some batches "
                                      "again and the run would not equal the uninterrupted one",
                                  fix="for step in hook.range(total): ... (or call hook.step() at the end of "
                                      "each iteration): the loop's own iterations become the clock; if a "
                                      "GradScaler skips the steps (fp16), pass it in the hook's dict")
            hook._bwd_since_step = True

        self._handles.append(first.register_hook(before_grad))
        self._handles.append(first.register_post_accumulate_grad_hook(on_grad))

    def _wrap_first_step(self, opt: Any, base: torch.optim.Optimizer) -> None:
        """SAM: the update spans ``first_step()`` (perturb the weights, keep the old ones in the wrapper's
        state) .. ``second_step()`` (restore, ``base_optimizer.step()``). The step begins at ``first_step``:
        a notice in between waits for the step to end, as one inside ``optimizer.step()`` does (the
        wrapper's state at the end of the previous iteration is gone by then)."""
        orig = opt.first_step
        hook = self

        def first_step(*args: Any, **kwargs: Any) -> Any:
            hook._pre_hook(base, args, kwargs)
            return orig(*args, **kwargs)

        opt.first_step = first_step
        self._unwrap.append((opt, "first_step"))

    def _remove_step_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, name in getattr(self, "_unwrap", []):
            try:
                delattr(obj, name)  # the instance attribute shadowing the method
            except AttributeError:
                pass
        self._unwrap = []
        if self._scaler is not None and self._scaler_orig is not None:
            for name in ("step", "update"):
                try:
                    delattr(self._scaler, name)  # the instance attribute shadowing the method
                except AttributeError:
                    pass
            self._scaler_orig = None

    def _on_forward(self, module: Any, args: Any) -> None:
        """Model forward pre-hook: the first *training* forward after step S — one that builds a graph (grad
        enabled; train or eval mode: fine-tuning with frozen BatchNorm) — marks the end of the loop's
        post-step work (its anchor). Not a forward under no_grad/inference_mode: an evaluation's, after which
        a loop may still change its state (``ReduceLROnPlateau.step(val_loss)``, a best-metric tracker) as
        part of iteration S. The buffers of the end of S are those the first forward that may change them
        found: any train-mode forward, no_grad included (a pseudo-label or teacher pass updates BatchNorm)."""
        if self._internal:
            return
        grad = torch.is_grad_enabled()
        self._last_fwd_training = module.training and grad
        if self._last_fwd_training:
            self._train_fwd_seq += 1
        if not module.training and not grad:
            return  # an evaluation's forward (eval mode, no grad): the iteration's post-step work goes on
        if self._fwd_seq != self._post_seq:  # the first forward after an optimizer step: buffers of the end
            self._fwd_seq = self._post_seq  # of the iteration (post-step updates in, this forward's not yet)
            self._fwd_bufs = (self._count, clone_buffers(self._buffers))
        if self._fwd_train_count != self._count and module.training:
            self._fwd_train_count = self._count
            if self._realign is not None:
                self._realign_rng()
            if self._bg_on:  # one optimizer: its step ends the iteration (not so with a GAN's two)
                self._fwd_rng = (self._count, torch.get_rng_state())  # ~1 us: see _realign_rng
            if self._bg_on and self._count > 0 and not self._range_clock:
                self._watch.mark()  # the post-step writes (AveragedModel, clipping) are part of iteration S
        if self._fwd_count == self._count or not self._bg_on or not grad:
            return
        self._fwd_count = self._count
        give_up = None
        with self._cv:
            if not self._range_clock:
                # What the loop may still change before the next step (a running-loss meter), copied here
                # every iteration: a round that starts later must not read that change into S.
                self._copy_at_anchor(self._count)
            if self._want_small == self._count and self._anchor_ok(self._count):  # a round waits: read it here
                self._capture_small_for(self._count, "forward")
            if not self._range_clock:
                # the exact fallback's read (_save_next_iteration)
                give_up = self._serve_anchor_read(self._count, "forward")
        if give_up is not None:
            self._give_up_hold(give_up)
        self._exit_if_requested()

    def _realign_rng(self) -> None:
        """First training forward after a resume: the torch RNG must be what the interrupted run had at its
        first training forward after step S (saved as ``rng_at_forward``). Anything that drew from the global
        RNG between the resume and here and did not draw in the uninterrupted run — typically a DataLoader
        iterator built without its own ``generator=`` — would shift every dropout mask after it."""
        saved, self._realign = self._realign, None
        if saved is None or torch.equal(torch.get_rng_state(), saved):
            return
        torch.set_rng_state(saved)
        self._log.warning(ev.RNG_REALIGNED, step=self._count,
                          why="the global torch RNG was drawn from between the resume and the first forward "
                              "(a DataLoader iterator without its own generator=?); the torch RNG was set back "
                              "to the interrupted run's, but whatever consumed that draw (a loader that shuffles "
                              "or has workers with it) got other seeds than the uninterrupted run",
                          fix="DataLoader(..., generator=torch.Generator().manual_seed(SEED)), or a stateful "
                              "loader / spotguard.data.ElasticDistributedSampler in the hook's dict")

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._explicit or self._closed or self._torn_down:
            return  # DCP's fake step() on a fresh optimizer lands here: never count it
        if self._range_clock and self._many_opts:
            self._multi_step_begin()
            return
        if self._many_opts:
            if self._scaler is not None or not self._cycle.begins(optimizer, self._count):
                return  # the scaler's step() wrapper counts (it sees steps the scaler skips); inside the iteration
        else:
            if self._clock is None:
                self._clock = optimizer
            if optimizer is not self._clock:
                return
        if not self._bg_on and self._bg is not None and not self._explicit_intent and not self._many_opts:
            self._enable_background()  # no hook.resume(): the first step is where training shows itself
        if self._bg_on and self._scaler is None:  # with a scaler, its step() wrapper is the begin
            self._step_begin()
        if self._agree.pending:
            self._boundary()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._explicit or self._closed or self._torn_down:
            return
        self._post_seq += 1
        self._bwd_since_step = False
        if self._many_opts:  # each optimizer's steps since the last explicit boundary (_multi_boundary_why)
            name = self._opt_key.get(id(optimizer))
            if name is not None:
                self._iter_steps[name] = self._iter_steps.get(name, 0) + 1
            if self._range_clock:
                return  # the explicit loop's boundary ends the iteration
        if self._scaler is not None:
            return  # GradScaler.update() is the clock
        if not self._many_opts:
            if optimizer is self._clock:
                self._decide()
        elif self._cycle_end(optimizer):
            self._decide()

    def _cycle_end(self, optimizer: Any) -> bool:
        """Several optimizers, implicit loop: a step ended; True at the iteration's first clock step (decide),
        else the snapshot follows the iteration's end so far."""
        if self._cycle.ends(optimizer):
            return True
        self._snap = Snapshot.take(self._objs.loaders)
        return False

    def _iterations_unproven(self, steps: dict[str, int], first: dict[str, int], clock_steps: int,
                             clock_first: int, why: str, **kind: Any) -> None:
        """The ``iterations_unproven`` warning (each of its kinds is said once by its caller)."""
        self._log.warning(ev.ITERATIONS_UNPROVEN, step=self._count, steps=steps, first=first,
                          clock_steps=clock_steps, clock_first=clock_first, **kind,
                          why="several optimizers in a loop without hook.range()/hook.step(): " + why,
                          fix="for i in hook.range(total) (or hook.step() at each iteration's end): the loop's own "
                              "boundaries count its iterations")

    def _tick(self) -> None:
        """An iteration boundary: how long the iteration took (the boundary path's warning at a notice)."""
        now = time.monotonic()
        last = getattr(self, "_boundary_at", None)
        if last is not None:
            self._iteration_seconds = now - last
        self._boundary_at = now

    def _decide(self) -> None:
        """End of an iteration as the hook sees it: count, snapshot, launch the flag reduction."""
        self._tick()
        if not self._fresh_checked:
            self._warn_unresumed()
        if self._torn_down:  # the process group is gone: count, but launch nothing
            self._count += 1
            return
        if self._bg_on:
            self._step_end()
            return
        if self._agree.pending:  # a decision no boundary consumed (unusual loop): settle it here, consistently
            res = self._agree.collect()
            if res is not None and res[0] > 0:
                self._act(res[0], res[1], snap=None, final=False)
        self._count += 1
        self._implicit_counted = True
        if self._many_opts and not self._explicit_intent and ("boundary", "implicit") not in self._path_logged:
            clock = self._opt_key.get(id(self._cycle.clock))
            if any(n > 0 for k, n in self._iter_steps.items() if k != clock):
                # the clock steps again after another optimizer did: past the first iteration, where a
                # hook.step() loop would have declared itself
                self._log_path("boundary", "implicit", self._implicit_why() or "")
        self._snap = Snapshot.take(self._objs.loaders)
        level, deadline_ms = self._local_level()
        self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _unconfirmed_cycle(self) -> None:
        """Before a commit at an implicit loop's boundary with several optimizers: ImplicitCycle.before_commit."""
        if self._many_opts and not self._explicit and not self._range_clock:
            self._cycle.before_commit()

    def _boundary(self) -> None:
        res = self._agree.collect()
        self._implicit_counted = False
        if res is not None and (res[0] > 0 or self._periodic_due()):  # a commit comes
            self._unconfirmed_cycle()
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=self._snap, final=False)
        elif res is not None:
            self._maybe_periodic(self._snap)

    def _enter_explicit(self) -> None:
        if self._explicit:
            return
        self._explicit = True
        self._range_clock = False
        self._bg_on = False  # the explicit boundary decides (the hook cannot see optimizer steps any more)
        self._remove_step_hooks()

    # ------------------------------------- explicit loops on the any-moment path (hook.range / hook.step)

    def _begin_explicit(self, loop: str, start: int) -> None:
        """An explicit loop starts (``hook.range()``, the first ``hook.step()``): any-moment if the optimizer
        clock is observable (one optimizer, the background agreement running), else the boundary path.

        Why the clock can stand for the loop: with one optimizer stepped once per iteration, the end of
        optimizer step S *is* the end of iteration S-1 as far as model and optimizer go, and the loop's
        boundary right after it is where the rest (scheduler, RNG, loader, buffers) is read. Each boundary
        checks that exactly one clock step ran since the previous one (``_clocked_boundary``); a round may
        only save a step that such a check has proven (``_confirmed``).
        """
        if self._explicit or self._range_clock:
            return
        bg = self._bg
        if bg is None or not bg.ok or bg.closed or self._torn_down or self._range_broken is not None:
            self._log_path("boundary", loop, self._range_broken or self._boundary_why or
                           "the background agreement is not available")
            self._enter_explicit()
            return
        if self._many_opts and self._agree.pending:
            self._agree.collect()  # a hook.step() loop's first iteration ran on the implicit (boundary) path:
            # every rank launched this reduction; a notice it carries is still pending and is armed below
        with self._cv:
            self._confirmed = start
            self._range_clock = True
            if self._many_opts:  # the count moves at boundaries; steps already in this iteration: inside it
                self._count = start
                self._in_step = bool(self._iter_steps)
        self._loop_kind = loop
        self._enable_background(clocked=True)
        if self._many_opts:
            self._log_path("any-moment", loop, f"{len(self._objs.optimizers)} optimizers: each boundary ends an "
                           "iteration and checks that every optimizer stepped as often as in the first one; "
                           "every optimizer's step waits while a round reads the state of the last boundary")
        else:
            self._log_path("any-moment", loop, "one optimizer: its step hooks mark each iteration's end; every "
                                              "boundary checks that exactly one optimizer step ran in the iteration")

    def _clocked_boundary(self, *, final: bool) -> None:
        """The loop's boundary on the any-moment path: prove "one clock step in this iteration", then record
        what the end of the iteration is (RNG, loader, buffers, the watch's mark) and serve a round that waits
        for this step's small state. Any other count hands the loop to the boundary path (``_leave_clock``)."""
        if not self._fresh_checked:
            self._warn_unresumed()
        expected = self._confirmed + 1
        why = self._range_broken
        if why is None and self._many_opts:
            why = self._multi_boundary_why(expected)
        elif why is None and (self._count != expected or self._in_step):
            why = (f"{self._count - self._confirmed} optimizer steps in the iteration that ended at boundary "
                   f"{expected} (gradient accumulation, a skipped or an extra optimizer.step()): optimizer steps "
                   "do not map one to one onto iterations")
        if why is not None:
            self._leave_clock(expected, why, final=final)
            return
        snap = Snapshot.take(self._objs.loaders)
        bufs = clone_buffers(self._buffers)
        self._watch.mark()  # the loop's post-step writes (AveragedModel, clipping) belong to this iteration
        if self._many_opts and self._cuda_params:
            self._step_event = torch.cuda.Event()
            self._step_event.record()  # the background read waits on it: this iteration's kernels are done
        with self._cv:
            if self._many_opts:  # the iteration ends here (``_multi_step_begin``): count it, leave "inside"
                self._count, self._in_step = expected, False
                self._iter_steps = {}
            self._snap, self._snap_count = snap, expected
            self._fwd_bufs, self._fwd_seq = (expected, bufs), self._post_seq
            self._confirmed = expected
            # The small state of this iteration's end, copied here and kept until the next boundary: the one
            # moment it is known exactly (the loop may change a stateful object before its next forward or
            # step). A round for this step takes it whenever it comes — no wait for an anchor. Copied, not
            # packed: packing (torch.save) costs ms, and only a round needs it (``_capture_small_for``).
            self._range_small = self._copy_small(expected, "iteration-boundary")
            if self._want_small == expected:
                self._capture_small_for(expected, "iteration-boundary")
            give_up = self._serve_anchor_read(expected, "iteration-boundary")  # the exact fallback's read
            self._cv.notify_all()
        if give_up is not None:
            self._give_up_hold(give_up)
        if self._many_opts and self._periodic is not None and not final:
            # the periodic vote launched at the last boundary is settled here, where the state is this
            # iteration's end: at the next optimizer step, the loop's work before it (a scheduler stepped at
            # the iteration's top, a meter, weights clipped before the critic's forward) would be saved as
            # part of this step
            if self._agree.pending:
                self._boundary()
            self._agree.launch(LEVEL_NONE, NO_DEADLINE_MS, self._periodic_flags())
        self._exit_if_requested()

    def _multi_boundary_why(self, expected: int) -> Optional[str]:
        """Several optimizers: None when every optimizer stepped in the iteration ending at boundary
        ``expected`` as often as in the first iteration of the loop (learned there), else why not — an
        optimizer that did not step carries gradients into the next iteration that no checkpoint holds."""
        steps = dict(self._iter_steps)
        idle = [k for k in self._objs.optimizers if steps.get(k, 0) < 1]
        if idle:
            return (f"optimizer(s) {', '.join(idle)} did not step in the iteration that ended at boundary "
                    f"{expected} (gradient accumulation, a skipped step): the state at that boundary is not an "
                    "iteration's end every optimizer agrees on")
        if self._step_pattern is None:
            self._step_pattern = steps
            return None
        if steps != self._step_pattern:
            return (f"optimizer steps {steps} in the iteration that ended at boundary {expected}, "
                    f"{self._step_pattern} in the first: the iteration's optimizer steps are not regular")
        return None

    def _multi_step_begin(self) -> None:
        """Several optimizers in an explicit loop: every optimizer's pre-hook. The iteration's first step
        marks "inside the iteration" (a round joining from then on stands at the next boundary); any step
        waits while a round holds the count (``_step_begin``), so no optimizer moves past the state a round
        reads. The periodic vote launched at the last boundary is settled at the next boundary."""
        if not self._bg_on:
            return
        self._step_begin()

    def _break_clock(self, why: str) -> None:
        """(under ``_cv``) The mapping iteration -> optimizer step is disproven: a round waiting for a step
        no boundary proved hands its notice to the boundary path."""
        if self._range_broken is None:
            self._range_broken = why
        self._cv.notify_all()

    def _leave_clock(self, expected: int, why: str, *, final: bool) -> None:
        """From this boundary on, this loop acts on notices at iteration boundaries (said once, with why).

        A round in flight either saves a step that was proven before (its commit then ends the process
        here) or hands its notice over (it stays pending, and the boundary reduction carries it)."""
        with self._cv:
            self._break_clock(why)
            if self._many_opts:
                self._in_step = False  # the boundary path counts from here (its steps are not watched)
        self._log_path("boundary", getattr(self, "_loop_kind", "hook.range()"), why)
        bg = self._bg
        if bg is not None and bg.busy.is_set():
            end = max(self._hold_until, time.monotonic()) + HOLD_SLACK
            with self._cv:
                while bg.busy.is_set() and self._exit_request is None and time.monotonic() < end:
                    self._cv.wait(0.05)  # `busy` clears without a notify: look again shortly
        self._exit_if_requested()
        self._count = expected
        self._enter_explicit()
        self._explicit_boundary(final=final)

    # ------------------------------------------- background agreement: the training thread's side

    def _enable_background(self, clocked: bool = False) -> None:
        """From now on notices are agreed off the training thread (see agreement.py): implicit loops, and
        explicit ones whose boundaries are checked against the optimizer clock (``clocked``)."""
        self._bg_ready.set()  # training starts here: a round may read this rank's count and resume state
        if self._bg is None or not self._bg.ok or self._explicit or self._bg_on or \
                (self._explicit_intent and not clocked):
            return
        if not clocked and self._implicit_why() is not None:
            return  # said in the second iteration (a hook.step() loop declares itself at the first's end)
        if not clocked:
            self._log_path("any-moment", "implicit", "one optimizer: its step hooks mark each iteration's end")
        self._turn_on_background()

    def _turn_on_background(self) -> None:
        """Notices wake the agreement thread from now on; those that came before training started (warm-up,
        resume) wake it now."""
        self._bg_on = True
        with self._lock:
            notices = list(self._pending.values())
        for n in notices:
            self._arm_wake(n)

    def _step_begin(self, enter: Optional[Callable[[], None]] = None) -> None:
        """Clock pre-hook (background mode): mark "inside optimizer.step", unless a round holds this step.

        While a round runs (``_freeze``: the count this rank said it will stand at)
        or after it agreed ``_target`` = S and this rank is at S, the step waits
        until the tensors of S are copied — for an emergency, until the exit (the
        small state of S is captured here first when this thread arrives before
        the copy is done). Bounded: past the round's deadline without a decision,
        a copy or an exit, the process exits 75. ``enter``: called under ``_cv``
        instead of marking "inside optimizer.step" (an adapter's other hold point).
        """
        give_up = None
        with self._cv:
            while self._exit_request is None:
                key = self._steps.held_at()
                if key is None or self._count < key:
                    if enter is None:
                        self._in_step = True
                    else:
                        enter()
                    return
                if self._count == key and not self._anchor_ok(key):
                    # an explicit loop's second optimizer step in one iteration: no boundary proved `key`
                    self._break_clock("two optimizer steps in one iteration: optimizer steps do not map one to "
                                      "one onto iterations")
                elif self._count == key:
                    if self._staged_step != key and (self._small is None or self._small[0] != key):
                        self._capture_small_for(key, "pre-hook")
                    if self._want_state == key and (self._handoff is None or self._handoff[0] != key) and \
                            self._fwd_count != key:  # past the anchor, this iteration's writes are in
                        self._read_for_round(key)  # a loop whose forwards the hook does not see
                left = self._steps.hold_left()
                if left <= 0:
                    give_up = key
                    break
                self._cv.wait(min(0.5, left))
        if give_up is not None:
            self._give_up_hold(give_up)
        self._exit_if_requested()

    def _wait_step_end(self, step: int, t_end: float) -> bool:
        """(agreement thread) Wait, bounded by ``t_end``, until this rank has ended ``step`` and is outside a
        step (held before the next); True when it has."""
        return self._steps.wait_step_end(step, t_end, lambda: self._exit_request is not None)

    def _give_up_hold(self, step: int) -> None:
        """Training thread, held past the round's bound (outside ``_cv``): leave with 75 rather than train on."""
        if self._exit_request is not None:
            return
        self._log.error(ev.PEERS_LOST, where="hold", step=step,
                        error="the agreement or the copy did not finish within the notice deadline")
        notice = self._best_notice() or agreed_notice(step, 0, "peers lost while holding the step")  # due now
        self._exit(notice, _Result(committed=False, peers_ok=False, error="hold timed out"), step)

    def _anchor_ok(self, step: int) -> bool:
        """May the small state of ``step`` be read now? Always in an implicit loop; in an explicit one only
        once the loop's boundary has proven that ``step`` ends an iteration (``_clocked_boundary``)."""
        return not self._range_clock or self._confirmed == step

    def _step_end(self) -> None:
        """Clock post-hook (background mode): count, snapshot, leave "inside optimizer.step"."""
        self._watch.mark()  # after step S: what a background read must still see (may track more buffers)
        # before the count: a round may read it at once (an explicit loop: taken at its boundary instead)
        snap = None if self._range_clock else Snapshot.take(self._objs.loaders)
        if self._cuda_params:
            self._step_event = torch.cuda.Event()
            self._step_event.record()  # the background read waits on it: step S's kernels are done
        with self._cv:
            count = self._steps.end_step()
            if snap is not None:
                self._snap, self._snap_count = snap, count
        self._implicit_counted = True
        if self._periodic is not None:  # the step-path reduction only carries periodic votes now
            if self._agree.pending:
                self._agree.collect()
            self._agree.launch(LEVEL_NONE, NO_DEADLINE_MS, self._periodic_flags())
        self._exit_if_requested()

    def _explicit_boundary(self, *, final: bool) -> None:
        self._tick()
        if not self._fresh_checked:
            self._warn_unresumed()
        if self._torn_down:  # after destroy_process_group(): no collective any more
            return
        res = self._agree.collect()
        self._implicit_counted = False
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=None, final=final)
        elif res is not None and not final:
            self._maybe_periodic(None)
        if not final:
            level, deadline_ms = self._local_level()
            self._agree.launch(level, deadline_ms, self._periodic_flags())

    # ---------------------------------------------------------------- notices

    # ------------------------------------------------------------- the action

    # --------------------------------------------------------- state <-> DCP

    # ----------------------------------------------------------- start / exit

    # ------------------------------------------------------- teardown guard

    # ------------------------------------------------------------ periodic



