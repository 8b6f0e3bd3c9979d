"""Lightning's any-moment path: a notice is agreed and written while the training step goes on.

Why: on the boundary path (``lightning.py``) a notice waits for the next
``on_train_batch_end`` — the step in flight, seconds to minutes on a real model —
before anything is agreed, because Lightning writes its checkpoint on the training
thread. Here, as in the plain hook (``agreement.py``) and DeepSpeed's engine
(``deepspeed_anymoment.py``), every rank's agreement thread (its own gloo group,
woken through the c10d store) decides the step S = the last completed optimizer
step (MAX of the ranks' stands) and writes S from the background:

- **What cannot move**: the weights, the optimizer's state, the step-interval
  schedulers and the precision plugin's scaler change only between Lightning's
  ``on_before_optimizer_step`` (called from ``Precision._after_closure``: forward and
  backward of the step are done, the weights not yet changed) and the step's
  ``on_train_batch_end`` (the scheduler has stepped). The step after S is HELD at
  its ``on_before_optimizer_step`` until they are written (an emergency: until the
  exit; an ordinary checkpoint: until they are copied to the host). Forward and
  backward of S+1 go on meanwhile: they touch gradients, not the checkpoint.
- **Gradient accumulation** (``accumulate_grad_batches`` > 1): the same, with S's
  copies taken at S's LAST micro-batch's ``on_train_batch_end``; the micro-batches
  after S (forward/backward only, ``global_step`` unchanged) neither copy nor wait, a
  notice among them is written for S at once and they are thrown away (the resumed
  run replays them from S's loop progress, the data position of S's end).
- **What moves between steps** — this rank's RNG, the module's persistent buffers
  (BatchNorm's running statistics), Lightning's loop progress and the callbacks'
  ``state_dict``s — is copied at every step's ``on_train_batch_end`` (the accumulation
  path's ``_AtStep``: the values a save at S's end would write) and substituted into
  the dict; the live objects are never rewound (the training thread uses them).
- **How it is written**: Lightning's own dict (``_checkpoint_connector.dump_checkpoint``:
  model state through ``strategy.lightning_module_state_dict()``, ``optimizer_state``,
  the schedulers, the precision plugin, hparams, datamodule, the ``on_save_checkpoint``
  hooks — no collective for ``DDPStrategy``/``SingleDeviceStrategy``) with S's copies
  put in, written by rank 0 through ``strategy.checkpoint_io`` into ``step-S/lightning.ckpt``
  — never ``trainer.save_checkpoint``, whose ``strategy.barrier()`` runs on the
  training process group the background thread must not touch. The RNG of every rank
  is gathered on the round's own group. Lightning's resume is unchanged
  (``trainer.ckpt_path``).
- **Validation and epoch ends**: an epoch end (``on_train_epoch_end``) and a validation's
  start (``on_validation_start``: ``WeightAveraging`` swaps the average into the module in place there) are held
  like a step while a round runs (the epoch-interval schedulers step after it). A round whose
  S is followed, on some rank, by a validation loop or an epoch end hands its notice
  to the boundary path (every rank alike: the reason travels in the gathered entries)
  and the process stays on the boundary path from its next optimizer step's end on (every
  rank is held before that step; a micro-batch is no common point of the ranks). So does
  a notice before the run's first step ends (no step-end copy yet) and one whose S is
  the run's last step (as on the boundary path, not acted on: training is over).

Configurations not proven exact keep the boundary path, said once in the
``notice_path`` line (``lightning_any_moment_refusal``): a strategy other than
``DDPStrategy``/``SingleDeviceStrategy`` (FSDP, DeepSpeed, ...), manual optimization,
several optimizers, a precision plugin other than ``Precision``/``MixedPrecision``,
``every=``, ``SPOTGUARD_BACKGROUND_AGREEMENT=0``, a user's own ``on_save_checkpoint`` (the module's, a
callback's, the datamodule's; or a datamodule ``state_dict``: it may write what moved since S, which no step-end
copy covers — the boundary path then acts at step ends only), and accumulation with a validation
that can run between two micro-batches (there the micro-batch path of ``lightning.py``
acts at the validation's next batch, rewound to S; the hand-over would wait for the
next step's end).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch

from ..save import _Result
from ..dist import NO_DEADLINE_MS
from ..settings import HANDED_OVER
from ..periodic import stage_state_dict
from ..state import pack

STATE_KEY = "spotguard"  # spotguard's entry in Lightning's checkpoint dict (lightning.py re-exports it)

__all__ = ["AnyMomentMixin", "lightning_any_moment_refusal", "own_save_hooks", "static_refusal"]

_STRATEGIES = ("DDPStrategy", "SingleDeviceStrategy")
_PRECISIONS = ("Precision", "MixedPrecision")


def static_refusal(trainer: Any, every: Optional[float]) -> Optional[str]:
    """What is known when the core arms (``setup``: before ``configure_optimizers``); None: maybe any-moment."""
    if os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT", "1").strip() == "0":
        return "SPOTGUARD_BACKGROUND_AGREEMENT=0"
    name = type(getattr(trainer, "strategy", None)).__name__
    if name not in _STRATEGIES:
        return f"strategy {name}: the any-moment path is proven for DDPStrategy and SingleDeviceStrategy only"
    if every is not None:
        return "every=: the periodic checkpoint is written at the step boundary"
    return None


def lightning_any_moment_refusal(trainer: Any, every: Optional[float] = None) -> Optional[str]:
    """None when the Trainer's checkpoint can be written from the background exactly (at ``on_train_start``:
    the optimizers exist); else why not."""
    why = static_refusal(trainer, every)
    if why is not None:
        return why
    if not hasattr(getattr(trainer, "_checkpoint_connector", None), "_get_loops_state_dict"):
        return "this Lightning's loop progress cannot be copied at a step's end"
    module = trainer.lightning_module
    if not getattr(module, "automatic_optimization", True):
        return "manual optimization: the module steps its optimizers itself, no hook marks a step's start"
    opts = list(getattr(trainer, "optimizers", []) or [])
    if len(opts) != 1:
        return f"{len(opts)} optimizers: the any-moment path is proven for one"
    if type(opts[0]).__name__ == "ZeroRedundancyOptimizer":
        return "ZeroRedundancyOptimizer: its state dict is consolidated by a collective on the training group"
    prec = type(getattr(trainer, "precision_plugin", None)).__name__
    if prec not in _PRECISIONS:
        return f"precision plugin {prec}: the any-moment path is proven for Precision and MixedPrecision only"
    return own_save_hooks(trainer) or _validation_between_micro_batches(trainer)


def own_save_hooks(trainer: Any) -> Optional[str]:
    """A user's ``on_save_checkpoint`` (the module's, a callback's, the datamodule's) or datamodule ``state_dict``
    puts into the checkpoint what it reads live — a "tokens seen" counter moved by the forwards since S — which no
    step-end copy covers: None when there is none (Lightning's own callbacks read nothing that moves between steps).
    The boundary path acts at a step's end then, never mid-accumulation (``lightning.py``'s ``_rewindable``)."""
    owners = [("the module", trainer.lightning_module, "on_save_checkpoint")]
    owners += [(f"callback {type(cb).__name__}", cb, "on_save_checkpoint") for cb in trainer.callbacks]
    dm = getattr(trainer, "datamodule", None)
    if dm is not None:
        owners += [("the datamodule", dm, "on_save_checkpoint"), ("the datamodule", dm, "state_dict")]
    for who, obj, name in owners:
        for cls in type(obj).__mro__:
            if name in vars(cls):
                if not cls.__module__.startswith(("lightning.", "pytorch_lightning.", "spotguard.")):
                    return (f"{who} overrides {name}: what it writes may have moved since the last optimizer step "
                            "(no step-end copy of it)")
                break
    return None


def _validation_between_micro_batches(trainer: Any) -> Optional[str]:
    """With accumulation, a validation that can run between two micro-batches keeps the micro-batch path: a notice
    during it is acted on at its next batch there (rewound to S), while the any-moment path would hand it over to
    the end of the next optimizer step. Validation at step ends and epoch ends only: None. (At ``on_train_start``
    Lightning has set ``val_check_batch``.)"""
    accum = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accum <= 1 or not getattr(trainer, "enable_validation", False):
        return None
    every = getattr(trainer, "val_check_batch", None)
    timed = getattr(trainer, "_val_check_time_interval", None) is not None  # every N seconds: any batch
    if not timed and (every is None or every == float("inf")):
        return None  # at the epoch's last batch: Lightning always steps there
    per_epoch = getattr(trainer, "num_training_batches", None)
    if not timed and isinstance(every, int):
        if isinstance(per_epoch, int) and every >= per_epoch:
            return None  # the epoch's last batch
        # counted in the epoch's batches (check_val_every_n_epoch set) or across epochs of whole accumulations
        if every % accum == 0 and (getattr(trainer, "check_val_every_n_epoch", 1) is not None
                                   or (isinstance(per_epoch, int) and per_epoch % accum == 0)):
            return None
    return (f"accumulate_grad_batches={accum} with validation every {every} batches: a validation can run between "
            "micro-batches, where the micro-batch path acts at its next batch")


@contextlib.contextmanager
def _this_thread_calls(obj: Any, name: str, fn: Callable[[], Any]) -> Iterator[None]:
    """``obj.name()`` is ``fn()`` for the calling thread only, the original for every other thread, while inside:
    the module's state dict of S goes into ``dump_checkpoint`` before its ``on_save_checkpoint`` hooks run
    (Lightning's ``WeightAveraging`` moves it to ``current_model_state``) — the training thread may save too."""
    me = threading.get_ident()
    original = getattr(obj, name)
    had = name in vars(obj)
    setattr(obj, name, lambda *a, **k: fn() if threading.get_ident() == me else original(*a, **k))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


class AnyMomentMixin:
    """Part of ``LightningHook`` (``lightning.py``); see the module docstring."""

    trainer: Any
    _lt_any = False  # this process acts at any moment (decided at arming, confirmed at on_train_start)
    _lt_at: Any = None  # the _AtStep of the last optimizer step's end (every step on this path)
    _lt_leave = False  # a round handed its notice over: the boundary path from the next batch end on

    # ------------------------------------------------------------------ which path

    def _why_not_background(self) -> Optional[str]:  # core.Hook: creates the agreement thread when None
        why = static_refusal(self.trainer, getattr(self, "_every", None))
        self._lt_any = why is None
        return why and f"{why} (the boundary path: a notice is acted on at the next optimizer step's end)"

    def _lt_begin(self) -> None:
        """``on_train_start`` (every rank, after the resume): the optimizers exist; announce the path."""
        if not self._lt_any:
            return
        why = lightning_any_moment_refusal(self.trainer, getattr(self, "_every", None))
        if why is None and (self._bg is None or not self._bg.ok):
            why = "the background agreement is not available"
        if why is not None:
            self._lt_any = False
            self._log_path("boundary", "lightning", why)
            return
        with self._steps.cv:  # no step of this run has ended: a notice before it waits for the boundary path
            self._loop.break_clock("no optimizer step of this run has ended yet", first=False)
        self._log_path("any-moment", "lightning", "weights, optimizer and schedulers change only between "
                                                  "on_before_optimizer_step and on_train_batch_end: the step "
                                                  "after S is held there until S is written")
        if self._rank == 0:
            self._lt_warm()
        self._enable_background()

    def _lt_warm(self) -> None:
        """Rank 0 writes a tiny file through ``checkpoint_io`` once: its first save imports and initialises what it
        uses (0.27 s on an idle box, more under load), paid here at training start instead of in a notice's
        seconds."""
        folder = tempfile.mkdtemp(prefix="spotguard-warm-")
        try:
            self.trainer.strategy.checkpoint_io.save_checkpoint({"warm": torch.zeros(1)}, os.path.join(folder, "w"))
        except Exception as exc:  # noqa: BLE001 - only a warm-up: the real save reports its own errors
            self._log.debug("checkpoint_io warm-up failed", error=repr(exc))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _enable_background(self, clocked: bool = False) -> None:  # core: resume() and the first step call it
        self._bg_ready.set()
        if not self._lt_any or self._bg is None or not self._bg.ok or self._bg_on or self._life.torn_down:
            return
        self._turn_on_background()

    def _hand_over(self, step: int, why: str) -> None:  # agreement.py: every rank alike
        super()._hand_over(step, why)  # type: ignore[misc]
        self._lt_leave = True

    def _capture_small_for(self, step: int, where: str) -> None:
        """core's pre-hook asks for the small state of the held step: here it is copied at every step's end."""

    # ------------------------------------------------------------------ the training thread

    def _lt_step_begin(self) -> None:
        """``on_before_optimizer_step``: held while a round needs S's weights, then "inside the step"."""
        if self._lt_any and self._bg_on:
            self._step_begin()

    def _lt_step_end(self, step: int, final: bool, snapshot: Callable[[int], Any]) -> bool:
        """``on_train_batch_end`` on this path: copy what moves between steps, count the step, leave "inside
        the step". False: this process is (now) on the boundary path, the caller goes on as before."""
        if not self._lt_any:
            return False
        if step == self._steps.count:
            # a micro-batch of an accumulation (no optimizer step): S's copies stand (none yet before the run's
            # first step: a round hands over), a round writes S meanwhile; the switch after a hand-over waits for
            # the step's end, where every rank is (the ranks' micro-batches are not in step with each other)
            self._exit_if_requested()
            return True
        if self._lt_leave:  # a round handed over: every rank switches at the same batch end
            self._lt_any = self._bg_on = False
            with self._steps.cv:
                self._steps.leave_step()
                self._steps.cv.notify_all()
            self._log_path("boundary", "lightning", "a notice came after validation or an epoch end since the "
                                                    "last optimizer step: the boundary path from here on")
            return False
        at = snapshot(step)
        with self._steps.cv:
            self._steps.reach(step)
            self._last_boundary = step
            self._lt_at = at
            self._loop.mend_clock()  # S's state is known again
            self._steps.cv.notify_all()
        self._finished = final
        self._tick()
        if not self._loop.fresh_checked:
            self._warn_unresumed()
        self._exit_if_requested()
        return True

    def _lt_unsafe(self, why: str, *, hold: bool) -> None:
        """Validation start / epoch end: from here until the next step's end the state is not S's end, which a
        round learns from ``_loop.range_broken`` (set atomically with passing the hold: a round joining later hands
        over). ``hold``: first wait while a round writes S, as at a step's start (core's ``_step_begin``)."""
        if not (self._lt_any and self._bg_on):
            return

        def dirty() -> None:  # under _steps.cv
            self._loop.break_clock(why)

        if hold:
            self._step_begin(enter=dirty)
        else:
            with self._steps.cv:
                dirty()

    def _eval_level(self) -> tuple[int, int]:
        """A validation batch inside fit on this path runs the boundary path's per-batch reduction
        (``_framework_eval_batch``: every rank the same batches), because a round during validation hands its
        notice over (``_loop.range_broken``: validation ran since S) and the validation's next batches are where it is
        acted on — not the next training batch after a validation of minutes. Only handed-over notices ride on it:
        a round that writes S itself (it began before the validation) is never raced by a second save on the
        training thread."""
        if self._lt_any and not self._lt_leave:
            return 0, NO_DEADLINE_MS
        return super()._eval_level()  # type: ignore[misc]

    def _lt_eval_end(self) -> None:
        """``on_validation_end`` (every rank): the reduction launched at the validation's last batch is settled
        here — acted on if it carries a handed-over notice — so no reduction is left over for the next one."""
        if not self._lt_any or self._life.over() or not self._agree.pending:
            return
        res = self._agree.collect()
        if res is not None and res[0] > 0:
            self._act_in_eval(res[0], res[1])

    # ------------------------------------------------------------------ the agreement thread

    def _save_staged(self, notice: Any, reason: str, step: int, t_end: float, group: Any, *,
                     hold: bool = False) -> _Result:
        """Wait (bounded) until this rank has ended step S, then write S: Lightning's dict with S's copies (an
        emergency's step stays held through the write until the exit; an ordinary one's until it is copied)."""
        last = int(getattr(self.trainer, "max_steps", -1) or -1)
        if not self._lt_any or 0 < last <= step:
            # the run's last step: as on the boundary path, a notice after the last optimizer step is not acted on
            # (training is over; the run ends with its own exit code) — every rank alike (same S, same max_steps)
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        t0 = time.monotonic()
        at = self._lt_at if self._wait_step_end(step, t_end) else None
        # every rank takes part in the gather, whatever it found: the others wait in it
        mine = at.rng if at is not None and at.step == step else None
        allv = self._bg.gather(mine, max(0.5, t_end - time.monotonic()))
        if any(v is None for v in allv):
            self._release_hold(keep_target=hold)
            return self._fail(notice, step, f"a rank did not reach the end of step {step} in time", t0,
                              peers_ok=True)
        def build() -> dict[str, Any]:
            ckpt = self._lt_dump(at, allv)
            return ckpt if hold else stage_state_dict(ckpt)[0]  # an ordinary one: on the host, training goes on

        return self._save_built(notice, reason, step, group, t_end, build=build, put=self._lt_put,
                                release=not hold)

    def _lt_dump(self, at: Any, rngs: list[Any]) -> dict[str, Any]:
        """Lightning's checkpoint dict for step S: its own ``dump_checkpoint`` (live weights, optimizer and
        schedulers: unchanged since S while the next step is held), with what moved since S replaced by S's
        copies: buffers, loops, callbacks, every rank's RNG (spotguard's entry, as the boundary path writes)."""
        conn = self.trainer._checkpoint_connector
        own = getattr(conn, "_get_lightning_module_state_dict", None)

        def at_s(sd: dict[str, Any]) -> dict[str, Any]:
            sd.update((name, t) for name, t in at.buffers.items() if name in sd)
            return sd

        if own is None:  # another Lightning: S's buffers put in after the hooks
            ckpt = conn.dump_checkpoint(weights_only=False)
            at_s(ckpt["state_dict"])
        else:  # S's buffers in before the hooks: a callback's on_save_checkpoint may move the module's state
            with _this_thread_calls(conn, "_get_lightning_module_state_dict", lambda: at_s(own())):
                ckpt = conn.dump_checkpoint(weights_only=False)
        ckpt["loops"] = at.loops
        if "callbacks" in ckpt:
            ckpt["callbacks"] = at.callbacks
        ckpt[STATE_KEY] = {"rng": pack(rngs), "world_size": self._world}
        return ckpt

    def _lt_put(self, key: str, ckpt: dict[str, Any]) -> None:
        """Rank 0 writes the dict through the strategy's ``checkpoint_io`` (no barrier: not ``save_checkpoint``)."""
        if self._rank != 0:
            return
        io = self.trainer.strategy.checkpoint_io
        self._place(key, lambda target: io.save_checkpoint(ckpt, str(target)))
