"""Hugging Face ``transformers.Trainer`` adapter: one ``TrainerCallback``.

**Two paths**, said once per process in the ``notice_path`` line:

- *any moment* (``hf_anymoment.py``; the default for DDP or one process, with or without gradient
  accumulation): the agreement thread decides S = the last completed optimizer step and writes the
  Trainer's own ``checkpoint-S`` files from the background while the forward/backward of S+1 go on;
  the training thread is held in ``on_pre_optimizer_step`` (right before ``optimizer.step()``). The
  callbacks below then only take the state of each step's end (``_capture`` at ``on_step_begin``) and
  mark the hold point; ``on_step_end`` / ``on_substep_end`` / ``on_save`` do nothing.
- *the step boundary* (the callbacks below): DeepSpeed, FSDP, ``eval_strategy`` other than ``"no"``,
  ``every=``, ``save_only_model``, ``SPOTGUARD_BACKGROUND_AGREEMENT=0`` (``any_moment_refusal``).

Life cycle on the boundary path (every rank):

- ``install_preemption_hook(trainer)`` adds ``SpotguardTrainerCallback``
  (``trainer.add_callback``) and arms the core at once when the Trainer has
  already initialised ``torch.distributed`` (it does in ``TrainingArguments`` /
  ``Trainer.__init__`` under torchrun), else at ``on_train_begin``.
- ``on_train_begin``: the Trainer has loaded ``resume_from_checkpoint``;
  ``resumed`` is logged and the ranks agree once (a replayed notice -> exit).
- ``on_step_end`` (after each optimizer + scheduler step): the agreement
  launched one step (or micro-batch) earlier is waited on the hook's gloo group. If any rank asked, *every* rank sets
  ``control.should_save`` (and ``control.should_training_stop`` for an
  emergency), so the Trainer itself writes ``checkpoint-N`` on all ranks —
  model, optimizer, scheduler, scaler, ``trainer_state.json`` and each rank's
  ``rng_state_<rank>.pth``.
- ``on_save`` (called right after that save, on every rank): each rank uploads
  what it owns — rank 0 the shared files, every rank its own RNG file — into
  ``<storage>/step-N/``; rank 0 commits once all ranks' bytes are durable; then
  teardown and ``Preempted`` (exit 143) out of ``trainer.train()``. A
  rebalance/maintenance notice commits the same way and training goes on.
- ``on_substep_end`` (gradient accumulation: each micro-batch that does not
  step the optimizer): the same agreement once per micro-batch; an agreed notice
  is acted on at once for the last completed optimizer step S, instead of at
  the end of the accumulation (8 micro-batches of 1 s and a 6 s notice: the
  step's end is past the deadline). Weights, optimizer and scheduler are still
  those of S; what the micro-batches since moved is put back for the save
  (``_rewound``): the RNG (taken at ``on_step_begin``, or at ``on_epoch_begin``
  for an epoch's first step: where the resumed Trainer restores it), the model's
  persistent buffers (``watch.model_snapshot_buffers``: running statistics, spectral norm's
  ``_u``/``_v``), the FLOP/token counters. ``global_step``
  and ``epoch`` have not moved, so the resumed Trainer skips ``S x
  accumulation`` batches of the epoch and replays the thrown-away micro-batches
  from the first one of step S+1 (also in an epoch's last, shorter
  accumulation). Without accumulation nothing of this runs: ``on_step_end``
  is the boundary, as before.
- ``on_prediction_step`` (each evaluation batch, e.g. ``eval_strategy="steps"``):
  the same agreement once per batch; an agreed notice is acted on at once for
  the last completed step (evaluation changes no weights): the Trainer writes
  ``checkpoint-N`` (``_save_checkpoint``) right there, spotguard commits it and
  exits, without waiting for the evaluation to end.

Resume: ``trainer.train(resume_from_checkpoint=hook.latest())`` — the newest
committed folder (downloaded first from an object store). The Trainer restores
model, optimizer, scheduler, scaler, every rank's RNG and the data position
(it skips the batches of the current epoch already seen); a Dataset/collator
drawing from the RNG is replayed for the batches fetched ahead (``hf_fetch.py``,
``spotguard_fetch_rng_<rank>.pt`` beside the Trainer's files, both paths).

``enable_jit_checkpoint`` (transformers >= 4.57): the Trainer's own SIGTERM
handler waits 3 s, then checkpoints on *the rank that got the signal* only —
with DDP the other ranks never enter the save's collectives (deadlock), and
nothing is committed. With spotguard installed it is switched off (warning
logged): spotguard's handler replaces it and the save happens on every rank
at one agreed step.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ...storage import Storage
from ..core import periodic_notice
from ..state import capture_rng, clone_buffers, rng_and_buffers_at
from ..watch import model_snapshot_buffers
from ._base import FrameworkHook
from ._files import upload_dir
from .accelerate_sampler import SAMPLER_GENERATORS, SamplerGenerators
from .hf_anymoment import HFAnyMomentMixin
from .hf_fetch import FetchRng

__all__ = ["HFTrainerHook", "install"]

_RANK_FILE = re.compile(r"^(?:rng_state_(\d+)\.pth|spotguard_fetch_rng_(\d+)\.pt|" + SAMPLER_GENERATORS + r"_(\d+)\.pt)$")
# deepspeed=: engine.save_checkpoint writes global_stepN/<bf16_>zero_pp_rank_<r>_mp_rank_00_{optim,model}_states.pt
# on rank r only (its own output_dir on its own disk)
_ZERO_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")


@dataclass
class _AtStep:
    """What a save of ``step`` must hold that moves during the next step's micro-batches (accumulation only)."""

    step: int
    epoch_start: bool  # taken at on_epoch_begin: the RNG before the epoch's iterator drew (what resume loads)
    rng: Optional[dict[str, Any]]  # None: the RNG files of the checkpoint this run resumed from
    bufs: dict[str, dict[str, torch.Tensor]]
    flos: float  # Trainer.current_flos + state.total_flos: _save_checkpoint folds one into the other
    total_flos: float
    tokens: Any  # state.num_input_tokens_seen
    # the stateful callbacks' state() (ExportableState, TrainerControl) before any callback's on_step_begin /
    # on_epoch_begin of the next step (hf_anymoment.callback_states); None: read them at the write
    callbacks: Optional[list[tuple[str, Any]]] = None
    # the RNG of the resumed run's first fetches (hf_fetch.FetchRng.at_window); None: none kept (epoch start)
    fetch: Optional[dict[str, Any]] = None


def _make_callback(hook: "HFTrainerHook") -> Any:
    from transformers import TrainerCallback

    class SpotguardTrainerCallback(TrainerCallback):  # type: ignore[misc]
        """spotguard's preemption callback (see spotguard.hook.adapters.hf)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._arm()
            hook._on_train_begin(int(state.global_step))
            hook._fetch.install(kwargs.get("train_dataloader"))
            hook._fetch.load(hook._resume_path, int(args.process_index), int(state.global_step))
            if hook._resume_path:  # use_seedable_sampler=False: the shuffle's generator (accelerate_sampler.py)
                hook._gens.load(Path(hook._resume_path), int(args.process_index))
            if hook._hf_any:
                hook._enable_background()
            return control

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._capture(int(state.global_step), epoch_start=True)
            return control

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._capture(int(state.global_step), epoch_start=False)
            if hook._hf_any and hook._armed:
                hook._hf_step_begin(int(state.global_step))
            return control

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if hook._hf_any and hook._armed and not (hook._life.closed or hook._internal or hook._life.torn_down):
                hook._hf_pre_optimizer()
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if hook._hf_any and hook._armed and not hook._life.detached():
                hook._hf_train_end(int(state.global_step))
            return control

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if not hook._hf_any:
                hook._framework_microbatch()
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._gens.step(int(state.global_step))  # the shuffle generator's state a save of this step sets
            hook._on_step_end(state, control)
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._on_save(control)
            return control

        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if not hook._hf_any:
                hook._framework_eval_batch()
            return control

    return SpotguardTrainerCallback()


def _make_front_callback(hook: "HFTrainerHook") -> Any:
    """The first callback of the Trainer's list: the stateful callbacks' state as at the end of the last step,
    before a user's ``on_step_begin`` / ``on_epoch_begin`` of the next one moves it (spotguard's own callback runs
    last: its capture would take the next step's begun)."""
    from transformers import TrainerCallback

    class SpotguardCallbackStates(TrainerCallback):  # type: ignore[misc]
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._capture_callbacks()
            return control

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            hook._fetch.step_begin()
            hook._capture_callbacks()
            return control

    return SpotguardCallbackStates()


class HFTrainerHook(HFAnyMomentMixin, FrameworkHook):
    framework = "transformers"

    def __init__(self, trainer: Any, storage: str | Storage | None = None, *, socket: str | None = None,
                 keep: int | None = None, exit_code: int = 143, on_notice: Optional[Any] = None,
                 every: Optional[float] = None) -> None:
        super().__init__(storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice, arm=False,
                         every=every)
        self.trainer = trainer
        self._plan_pending: Optional[tuple[Any, list[str], str]] = None
        # Gradient accumulation: a notice is acted on at the next micro-batch, for the last optimizer step
        # (_framework_microbatch); what moved since is taken at each step's start (_capture). Off without it.
        self._accumulating = int(getattr(getattr(trainer, "args", None), "gradient_accumulation_steps", 1) or 1) > 1
        self._at: Optional[_AtStep] = None
        self._snap_bufs: Optional[dict[str, dict[str, torch.Tensor]]] = None
        self._resume_path: Optional[str] = None  # the folder this run resumed from (its RNG files)
        self._rng_from: Optional[str] = None  # set during a rewound save whose RNG is that folder's files
        self._jit_disabled = self._disable_jit_checkpoint()
        self._fetch = FetchRng(trainer, lambda: self._log)  # a Dataset/collator drawing from the RNG (hf_fetch.py)
        # accelerator_config use_seedable_sampler=False: each epoch's order from the sampler's own generator, which the
        # Trainer's checkpoint does not hold (review obrev: resumed past the first epoch, another order)
        self._gens = SamplerGenerators(getattr(trainer, "accelerator", None))
        self._rewinding: Optional[_AtStep] = None  # the capture a save inside _rewound stands for
        self.callback = _make_callback(self)
        trainer.add_callback(self.callback)
        self._cb_states: Optional[list[tuple[str, Any]]] = None  # _capture_callbacks
        handler = getattr(trainer, "callback_handler", None)
        if handler is not None and isinstance(getattr(handler, "callbacks", None), list):
            handler.callbacks.insert(0, _make_front_callback(self))
        if dist.is_available() and dist.is_initialized():
            self._arm()
        if self._jit_disabled:
            self._log.warning("enable_jit_checkpoint switched off: spotguard saves on every rank at one agreed "
                              "step instead (the Trainer's JIT save runs on the signalled rank only)")

    # ------------------------------------------------------------- JIT checkpoint

    def _disable_jit_checkpoint(self) -> bool:
        """Remove the Trainer's per-rank SIGTERM checkpoint (restoring the handler it replaced)."""
        handler = getattr(self.trainer, "callback_handler", None)
        found = False
        for cb in list(getattr(handler, "callbacks", [])):
            mgr = getattr(cb, "jit_manager", None)
            if type(cb).__name__ != "JITCheckpointCallback" or mgr is None:
                continue
            found = True
            orig = getattr(mgr, "_original_sigterm_handler", None)
            try:
                if signal.getsignal(signal.SIGTERM) == getattr(mgr, "_sigterm_handler", None):
                    signal.signal(signal.SIGTERM, orig if orig is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
            cb.jit_manager = None
        return found

    # ------------------------------------------------------------- callbacks

    def _on_train_begin(self, step: int) -> None:
        resumed_from = None
        if self._latest is not None and step == self._latest[1] and step > 0:
            resumed_from = self._latest[0]
        self._resume_path = resumed_from
        self._started(step, resumed_from)

    def _capture(self, step: int, *, epoch_start: bool, window: bool = True) -> None:
        """With accumulation, at each epoch's and step's start (every rank): the state a checkpoint of ``step``
        (the last completed optimizer step) holds, which the micro-batches to come move (RNG, running statistics,
        FLOP and token counters). The RNG a resumed run restores is the one before the epoch's iterator draws
        (``on_epoch_begin``) at an epoch start, after the step's batches are fetched (``on_step_begin``) otherwise:
        the first capture of an epoch's first step is kept. Right after a resume the Trainer restores the RNG
        only after these callbacks: the resumed folder's RNG files stand for it. ``window``: the next step's
        ``get_batch_samples`` has run (not at ``on_train_end``): the RNG of its fetches is kept (``hf_fetch.py``)."""
        if not (self._accumulating or self._hf_any) or not self._armed:
            return
        if self._at is not None and self._at.step == step and self._at.epoch_start:
            return
        tr = self.trainer
        if self._snap_bufs is None:
            self._snap_bufs = {"model": model_snapshot_buffers(tr.model)}
        resumed_here = step == self._resumed_step and step > 0
        self._at = _AtStep(step, epoch_start, None if resumed_here else capture_rng(),
                           clone_buffers(self._snap_bufs) if self._snap_bufs["model"] else {},
                           float(getattr(tr, "current_flos", 0.0)), float(tr.state.total_flos),
                           tr.state.num_input_tokens_seen, self._cb_states if self._hf_any else None,
                           None if epoch_start or not window else self._fetch.at_window())

    def _on_step_end(self, state: Any, control: Any) -> None:
        if self._life.closing():
            return
        if self._hf_any:  # the any-moment path (hf_anymoment.py): the background rounds act, not this boundary
            self._tick()
            self._exit_if_requested()
            return
        step = int(state.global_step)
        final = bool(state.max_steps) and state.max_steps > 0 and step >= state.max_steps
        self._steps.set_count(step)
        res = self._agree.collect()
        if res is not None and res[0] == 0 and not final and self._every is not None and self._agree.flags[0]:
            # every=: some rank is due: every rank has the Trainer write checkpoint-<step> now (on_save uploads)
            self._plan_pending = (periodic_notice(step), [], "periodic")
            self._full_saves(True)
            control.should_save = True
            return
        if res is not None and res[0] > 0:
            self._internal = True
            try:
                plan = self._plan(res[0], res[1], final=final)
            finally:
                self._internal = False
            if plan is not None:
                notice, _, action = plan
                if action == "exit":
                    self._exit(notice, None)
                # Every rank sets the same flags: the Trainer writes checkpoint-<step> on all ranks now.
                self._plan_pending = plan
                self._full_saves(True)
                control.should_save = True
                if action == "emergency":
                    control.should_training_stop = True
                return  # the next agreement starts after the commit (on_save)
        if not final:
            level, deadline_ms = self._local_level()
            self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _full_saves(self, on: bool) -> None:
        """``save_only_model=True`` makes the Trainer write the weights only; a resume from them restarts the
        optimizer, scheduler and RNG, so spotguard's own checkpoints are written in full: the flag is off from
        the moment spotguard asks the Trainer to save until that save is over (the Trainer's own saves keep it)."""
        args = self.trainer.args
        if on and getattr(args, "save_only_model", False):
            args.save_only_model = False
            self._only_model = True
        elif not on and getattr(self, "_only_model", False):
            args.save_only_model = True
            self._only_model = False

    def _on_save(self, control: Any) -> None:
        plan, self._plan_pending = self._plan_pending, None
        self._full_saves(False)
        if plan is None:
            return  # one of the Trainer's own periodic saves
        self._internal = True
        try:
            self._carry_out(plan, None)  # an emergency never returns: Preempted
        finally:
            self._internal = False
        if plan[2] == "periodic":
            self._restart_every()  # also after a failure: retry one period later
        level, deadline_ms = self._local_level()
        self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _act_in_eval(self, level: int, deadline_ms: int) -> None:
        """During evaluation: the Trainer writes ``checkpoint-<step>`` itself first, then commit (and exit)."""
        self._internal = True
        try:
            plan = self._plan(level, deadline_ms, final=False)
            if plan is None:
                return
            if plan[2] != "exit":
                self._full_saves(True)
                try:
                    self.trainer._save_checkpoint(self.trainer.model, trial=None)
                finally:
                    self._full_saves(False)
                if self._rng_from is not None:  # a rewound save right after a resume: that folder's RNG
                    self._copy_rng_files(self._rng_from)
            self._carry_out(plan, None)  # an emergency never returns: Preempted
        finally:
            self._internal = False

    def _act_in_microbatch(self, level: int, deadline_ms: int) -> None:
        """Between two micro-batches: as in evaluation, inside ``_rewound``. Without a capture of the last step
        (resumed from a folder the hook does not know) nothing is done: the notice stays pending and every
        rank acts on it at the step's end, as without accumulation; so too in the first step (nothing to rewind to:
        its end is the first checkpoint)."""
        at = self._at
        if at is None or at.step != self._steps.count or self._steps.count == 0 or \
                (at.rng is None and self._resume_path is None):
            return
        self._act_in_eval(level, deadline_ms)

    @contextlib.contextmanager
    def _rewound(self) -> Iterator[None]:
        """RNG, running statistics and the FLOP/token counters of the last optimizer step, for one save."""
        at, tr = self._at, self.trainer
        if at is None or at.step != self._steps.count:
            yield
            return
        live = (getattr(tr, "current_flos", 0.0), tr.state.total_flos, tr.state.num_input_tokens_seen)
        with rng_and_buffers_at(at.rng, self._snap_bufs or {}, at.bufs):
            if at.rng is None:
                self._rng_from = self._resume_path
            tr.current_flos, tr.state.total_flos, tr.state.num_input_tokens_seen = at.flos, at.total_flos, at.tokens
            self._rewinding = at
            try:
                yield
            finally:
                self._rng_from, self._rewinding = None, None
                tr.current_flos, tr.state.total_flos, tr.state.num_input_tokens_seen = live

    def _copy_rng_files(self, src: str) -> None:
        """This rank's RNG file of the resumed folder over the one just written (the Trainer loads it by name)."""
        folder = self._checkpoint_folder()
        for name in (f"rng_state_{self._rank}.pth", "rng_state.pth"):
            if os.path.isfile(os.path.join(src, name)) and os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))

    # ------------------------------------------------------------- writing

    def _checkpoint_folder(self) -> str:
        tr = self.trainer
        get = getattr(tr, "_get_output_dir", None)
        run_dir = get(trial=None) if callable(get) else tr.args.output_dir
        return os.path.join(run_dir, f"checkpoint-{self._steps.count}")

    def _write(self, key: str, snap: Any) -> None:
        """Upload this rank's share of the folder the Trainer has just written."""
        folder = self._checkpoint_folder()
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"the Trainer did not write {folder}")
        at = self._rewinding
        self._fetch.write(folder, int(self.trainer.args.process_index), self._steps.count,
                          at.fetch if at is not None else self._fetch.at_boundary())
        self._gens.write(Path(folder), int(self.trainer.args.process_index), self._gens.of(self._steps.count))
        self._upload(folder, key)

    def _upload(self, folder: str, key: str) -> None:
        """This rank's share of a ``checkpoint-N`` folder into ``key``."""
        upload_dir(self._storage, folder, key, select=self._mine)

    def _mine(self, rel: str) -> bool:
        """Whether file ``rel`` of a ``checkpoint-N`` folder is this rank's to store: each rank its RNG file and
        (DeepSpeed ZeRO) its partition files, rank 0 the rest."""
        m = _RANK_FILE.match(rel) or _ZERO_FILE.search(rel)
        return int(next(g for g in m.groups() if g)) == self._rank if m else self._rank == 0


def install(trainer: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> HFTrainerHook:
    return HFTrainerHook(trainer, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                         every=every)
