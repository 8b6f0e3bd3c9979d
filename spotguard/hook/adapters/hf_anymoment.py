"""The HF ``transformers.Trainer``'s any-moment path: a notice is agreed and written while the training thread goes on.

Why: on the boundary path (``hf.py``) a notice waits for the next ``on_step_end``
(the step in flight: seconds on a fine-tuning job) before anything is agreed, and the
Trainer's own ``_save_checkpoint`` then runs on the training thread. Here, as in the
plain hook (``agreement.py``), every rank's agreement thread (its own gloo group,
woken through the c10d store) decides the step S = the last completed optimizer step
(MAX of the ranks' stands: a rank past ``on_pre_optimizer_step`` stands at the step it
is finishing) and writes S from the background:

- **What cannot move**: weights, optimizer, scheduler and scaler change only from
  ``self.optimizer.step()`` on (the Trainer clips the gradients *before*
  ``on_pre_optimizer_step``; clipping touches gradients only). The step after S is
  held in ``on_pre_optimizer_step`` (core ``_step_begin``) until they are written —
  an emergency until the exit; an ordinary checkpoint until its files are on local
  disk. Forward and backward of S+1 (every micro-batch of it with gradient
  accumulation) go on meanwhile: they touch gradients, which a checkpoint does not hold.
- **What moves between steps** is taken as at S's end, at the next ``on_step_begin``
  (``on_epoch_begin`` for an epoch's first step: where the resumed Trainer loads its
  RNG), exactly as the accumulation path's ``_capture`` (``hf.py``): the RNG, the
  model's persistent buffers (BatchNorm running statistics), the FLOP and token
  counters. "S is complete" means that capture is done: the Trainer's logging,
  its own saves and an epoch end after S's ``optimizer.step()`` are over, so the
  ``TrainerState`` (global_step, epoch, log_history) is S's. The data position is
  ``global_step`` (the resumed Trainer skips the batches itself).
- **How it is written**: the Trainer's own files of ``checkpoint-S`` (``_save`` for
  the weights and ``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``,
  ``scaler.pt``, ``rng_state[_<rank>].pth``, ``trainer_state.json`` with the
  stateful callbacks as at S's end: taken by a callback put first in the Trainer's list, before a
  user's ``on_step_begin``/``on_substep_end`` of S+1 moves them), without ``_save_checkpoint``. An emergency into
  a local store (S held until the exit) writes them straight into ``step-S/`` inside the save, each file read back
  (its checksum, for the commit record) and fsynced on a thread as soon as it is closed, overlapping the next
  file's serialisation; anything else (an object store, an ordinary notice, whose hold ends once the files
  are on local disk) writes them into a local staging folder and uploads them. Not ``_save_checkpoint``: that
  one all-gathers the FLOP count (``store_flos``) and may ``dist.barrier()`` on the training group, which the
  background thread must never touch (the training thread may be in DDP's all-reduce of the next backward). The
  FLOP count is summed as ``store_flos`` does, each rank's value passed through the c10d store. The resume is
  unchanged: ``trainer.train(resume_from_checkpoint=hook.latest())``. ``checkpoint_staged`` gives the seconds of
  each part (``parts``: wait for S's end, model, optimizer, small files, the wait for the checksum/fsync threads,
  the report) and ``in_place``.

Configurations this is not proven exact for keep the boundary path, said once in the
``notice_path`` line (``any_moment_refusal``): DeepSpeed, FSDP, evaluation during
training (``eval_strategy`` other than ``"no"``: an evaluation between S and the
notice is acted on per batch by the boundary path), ``every=`` (periodic saves are
the Trainer's, at its boundary), ``save_only_model``, and
``SPOTGUARD_BACKGROUND_AGREEMENT=0``. A round for the run's last step (``state.max_steps``) commits nothing:
training is over, as on the boundary path the notice is named (``notice_after_last_step``) and the run ends with its
own code (a checkpoint of max_steps made the restarted Trainer, transformers 5.24, train one step more). The last
step is complete at ``on_train_end`` (no ``on_step_begin`` follows): a round waiting for it is served there.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ...storage.commit import step_dir
from ...storage.integrity import FileDigest
from .. import events as ev
from ..save import _Result
from ..settings import HANDED_OVER
from ._files import file_digest, report_local, staging_dir
from .hf_fetch import FETCH_RNG

__all__ = ["HFAnyMomentMixin", "any_moment_refusal"]

_FLOS_KEY = "spotguard/hf-flos"


def any_moment_refusal(trainer: Any, every: Any = None) -> Optional[str]:
    """None when this Trainer's checkpoint can be written from the background exactly; else why not."""
    if os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT", "1").strip() == "0":
        return "SPOTGUARD_BACKGROUND_AGREEMENT=0"
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(args, "deepspeed", None):
        return "DeepSpeed: its engine's checkpoint is written by engine.save_checkpoint, with collectives"
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(args, "fsdp", None):
        return "FSDP: the sharded state is gathered by collectives on the training group"
    strategy = str(getattr(getattr(args, "eval_strategy", "no"), "value", getattr(args, "eval_strategy", "no")))
    if strategy != "no":
        return (f"eval_strategy={strategy!r}: an evaluation between two steps is not proven quiet for a background "
                "write (its batches act on a notice at once instead)")
    if every is not None:
        return "every=: the periodic checkpoints are the Trainer's own, written at its step boundary"
    if getattr(args, "save_only_model", False):
        return "save_only_model=True: not proven for the background writer"
    return None


class HFAnyMomentMixin:
    """Part of ``HFTrainerHook`` (``hf.py``); see the module docstring."""

    trainer: Any
    _hf_any: bool = False
    _hf_ended = False  # on_train_end came: no on_step_begin completes a step any more

    # ------------------------------------------------------------------ the path

    def _why_not_background(self) -> Optional[str]:  # core.Hook: creates the agreement thread when None
        why = any_moment_refusal(self.trainer, getattr(self, "_every", None))
        self._hf_any = why is None
        return why and f"{why} (the boundary path: a notice is acted on at the next on_step_end)"

    def _arm(self, state: Optional[dict[str, Any]] = None) -> None:
        if getattr(self, "_armed", False):
            return
        super()._arm(state)  # type: ignore[misc]
        if self._hf_any and self._bg is not None and self._bg.ok:
            self._log_path("any-moment", "transformers", "weights, optimizer and scheduler change only from "
                                                         "optimizer.step(): the step after S is held in "
                                                         "on_pre_optimizer_step until they are written")
        elif self._hf_any:
            self._hf_any = False
            self._log_path("boundary", "transformers", "the background agreement is not available")

    def _enable_background(self, clocked: bool = False) -> None:  # on_train_begin
        self._bg_ready.set()
        if not self._hf_any or self._bg is None or not self._bg.ok or self._bg_on or self._life.torn_down:
            return
        if self.trainer.args.should_save:
            _warm_save_pretrained(self.trainer.model, self._log)
        self._turn_on_background()  # core: notices that came before training started wake the round now

    def _capture_callbacks(self) -> None:
        """At the front of ``on_epoch_begin`` / ``on_step_begin``: what the stateful callbacks hold at the end of the
        last step (``_capture`` attaches it to the step's capture); a user's callback may count at those events, or
        at each micro-batch (``on_substep_end``), before the background write reads it."""
        self._cb_states = callback_states(self.trainer) if self._hf_any and getattr(self, "_armed", False) else None

    def _capture_small_for(self, step: int, where: str) -> None:
        """core's pre-hook asks for the small state of the held step: here it is taken at each step's start."""

    # ------------------------------------------------------------------ the training thread

    def _hf_step_begin(self, step: int) -> None:
        """``on_step_begin`` (after ``_capture``): step ``step`` is complete, its end state known."""
        with self._steps.cv:
            self._steps.reach(step)
            self._last_boundary = step
            self._steps.cv.notify_all()
        self._exit_if_requested()

    def _hf_pre_optimizer(self) -> None:
        """``on_pre_optimizer_step``: held here while a round needs the weights of the last completed step."""
        if not self._bg_on:
            self._enable_background()
        self._step_begin()

    def _hf_train_end(self, step: int) -> None:
        """``on_train_end``: the last step is complete now (no ``on_step_begin`` follows): its end state is taken
        here, a round of it is served (an emergency holds this thread until the exit, as at a step's start), and
        a later round writes it from the live state (the loop's work is over)."""
        self._capture_callbacks()  # the last one was taken before the last step began
        self._capture(step, epoch_start=False, window=False)  # type: ignore[attr-defined]
        self._hf_step_begin(step)
        self._step_begin()
        with self._steps.cv:
            self._hf_ended = True
            self._steps.leave_step()
            self._steps.cv.notify_all()
        self._exit_if_requested()

    # ------------------------------------------------------------------ the agreement thread

    def _save_staged(self, notice: Any, reason: str, step: int, t_end: float, group: Any, *,
                     hold: bool = False) -> _Result:
        """Wait (bounded) until this rank has completed step S and is before the next optimizer step, write S's
        files to local disk (held), then upload and commit them (an emergency stays held until the exit)."""
        last = int(getattr(getattr(self.trainer, "state", None), "max_steps", 0) or 0)
        if not self._hf_any or 0 < last <= step:
            # the run's last step (review hfrev): as on the boundary path (and Lightning's), a notice after the last
            # optimizer step is not acted on — training is over, the run ends with its own code; a commit of it
            # made the restarted Trainer (transformers 5.24, resumed at global_step == max_steps) train one more
            # step. Every rank alike (same S, same max_steps)
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        t0 = time.monotonic()
        with self._steps.cv:
            while (self._steps.count != step or self._steps.in_step) and not self._life.exit_requested and not self._hf_ended:
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self._steps.cv.wait(min(0.5, left))
            at = self._at if self._steps.count == step and not self._steps.in_step else None
        if at is None or at.step != step:
            self._release_hold(keep_target=hold)
            return self._fail(notice, step, f"training ended at step {self._steps.count}, not {step}" if self._hf_ended
                              else f"this rank did not reach the end of step {step} in time", t0, peers_ok=True)
        parts: dict[str, float] = {"wait": time.monotonic() - t0}
        if hold and self._storage.local_path(step_dir(step)) is not None:
            # an emergency into a local store: S stays held until the exit, so the files are written straight
            # into step-S/ inside the save (after rank 0 has prepared the folder) — no staging copy, no re-read
            return self._save_built(notice, reason, step, group, t_end, build=lambda: self._hf_flos(at, t_end),
                                    put=lambda key, flos: self._hf_in_place(notice, key, at, flos, parts, t0),
                                    release=False)

        def build() -> str:
            out = str(staging_dir("hf-any"))
            self._hf_write(out, at, self._hf_flos(at, t_end), parts)
            self._log.info(ev.CHECKPOINT_STAGED, notice_id=notice.id, step=step, in_place=False,
                           seconds=round(time.monotonic() - t0, 4), parts=_rounded(parts))
            return out

        return self._save_built(notice, reason, step, group, t_end, build=build,
                                put=lambda key, folder: self._upload(str(folder), key), release=not hold,
                                done=lambda folder: shutil.rmtree(folder, ignore_errors=True))

    def _hf_in_place(self, notice: Any, key: str, at: Any, flos: float, parts: dict[str, float], t0: float) -> None:
        """This rank's files of ``checkpoint-S`` written into the local store's ``key`` folder, each one checksummed
        and fsynced on a thread as soon as it is closed (``_Closed``), then reported for the commit record as
        ``report_local`` does (the commit makes the folder durable again: cheap by then)."""
        folder = self._storage.local_path(key)
        assert folder is not None
        os.makedirs(folder, exist_ok=True)
        closed = _Closed()
        try:
            self._hf_write(str(folder), at, flos, parts, closed.start)
        finally:
            t = time.monotonic()
            digests = closed.wait()
            parts["closing"] = time.monotonic() - t
        t = time.monotonic()
        report_local(self._storage, key, select=self._mine, known=digests)  # type: ignore[attr-defined]
        parts["report"] = time.monotonic() - t
        self._log.info(ev.CHECKPOINT_STAGED, notice_id=notice.id, step=at.step, in_place=True,
                       seconds=round(time.monotonic() - t0, 4), parts=_rounded(parts))

    def _hf_flos(self, at: Any, t_end: float) -> float:
        """``state.total_flos`` as ``store_flos`` would have made it at S's save: every rank's FLOPs since the
        last store, summed (float32, as its all-gather) — passed through the c10d store, not the training group."""
        from transformers.training_args import ParallelMode  # noqa: PLC0415

        if self.trainer.args.parallel_mode != ParallelMode.DISTRIBUTED:
            return at.total_flos + at.flos
        vals = [at.flos] * self._world
        store = getattr(self._bg, "_setter", None)
        if self._world > 1:
            if store is None:
                raise RuntimeError("no c10d store to sum the ranks' FLOP counts through")
            store.set(f"{_FLOS_KEY}/{at.step}/{self._rank}", repr(at.flos))
            if self._rank == 0:
                keys = [f"{_FLOS_KEY}/{at.step}/{r}" for r in range(1, self._world)]
                store.wait(keys, timedelta(seconds=max(0.5, t_end - time.monotonic())))
                vals[1:] = [float(store.get(k).decode()) for k in keys]
        return at.total_flos + torch.tensor(vals).sum().item()

    def _hf_write(self, out: str, at: Any, flos: float, parts: dict[str, float],
                  closed: Callable[[str], None] = lambda path: None) -> None:
        """This rank's files of ``checkpoint-S`` into folder ``out``, as ``Trainer._save_checkpoint`` writes them
        (no collective); ``closed(path)`` after each file is written; the seconds of each part into ``parts``."""
        from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME  # noqa
        tr = self.trainer
        t = time.monotonic()
        if tr.args.should_save:
            sd = tr.model.state_dict()  # not copied: held, and written before the hold ends (tied weights stay tied)
            for name, tensor in (at.bufs.get("model") or {}).items():
                if name in sd:
                    sd[name] = tensor
            tr._save(out, state_dict=sd)
            for name in sorted(os.listdir(out)):  # the weights and training_args.bin (config.json, ...)
                closed(os.path.join(out, name))
            parts["model"], t = time.monotonic() - t, time.monotonic()
            torch.save(tr.optimizer.state_dict(), os.path.join(out, OPTIMIZER_NAME))
            closed(os.path.join(out, OPTIMIZER_NAME))
            parts["optimizer"], t = time.monotonic() - t, time.monotonic()
            torch.save(tr.lr_scheduler.state_dict(), os.path.join(out, SCHEDULER_NAME))
            scaler = getattr(tr.accelerator, "scaler", None)
            if scaler is not None:
                torch.save(scaler.state_dict(), os.path.join(out, SCALER_NAME))
            state = copy.deepcopy(tr.state)
            state.total_flos, state.num_input_tokens_seen = flos, at.tokens
            for name, st in at.callbacks if at.callbacks is not None else callback_states(tr):
                if isinstance(state.stateful_callbacks.get(name), list):  # as _save_checkpoint merges them
                    state.stateful_callbacks[name].append(st)
                else:
                    state.stateful_callbacks[name] = st
            state.save_to_json(os.path.join(out, TRAINER_STATE_NAME))
        rng_name = "rng_state.pth" if tr.args.world_size <= 1 else f"rng_state_{tr.args.process_index}.pth"
        if at.rng is not None:
            torch.save(_trainer_rng(at.rng, tr.args), os.path.join(out, rng_name))
        elif self._resume_path is not None and os.path.isfile(os.path.join(self._resume_path, rng_name)):
            shutil.copyfile(os.path.join(self._resume_path, rng_name), os.path.join(out, rng_name))
        else:
            raise RuntimeError(f"the RNG of step {at.step} is not known (resumed from an unknown folder)")
        self._fetch.write(out, tr.args.process_index, at.step, at.fetch)  # type: ignore[attr-defined]
        self._gens.write(Path(out), tr.args.process_index, self._gens.of(at.step))  # type: ignore[attr-defined]
        closed(os.path.join(out, f"{FETCH_RNG}_{tr.args.process_index}.pt"))
        parts["small"] = time.monotonic() - t


class _Closed:
    """Each written file checksummed and fsynced on its own thread as soon as it is closed (the read, the CRC and
    the fsync release the GIL): the disk and the second core work on one file while the next is serialised.
    ``wait`` joins them, raises the first error and returns the digests (absolute path -> digest)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._digests: dict[str, FileDigest] = {}

    def start(self, path: str) -> None:
        if os.path.isfile(path) and path not in self._digests:
            t = threading.Thread(target=self._close, args=(path,), name="spotguard-hf-fsync", daemon=True)
            t.start()
            self._threads.append(t)

    def _close(self, path: str) -> None:
        try:
            digest = file_digest(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._digests[path] = digest
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), on the writing thread
            self._errors.append(exc)

    def wait(self) -> dict[str, FileDigest]:
        for t in self._threads:
            t.join()
        if self._errors:
            raise self._errors[0]
        return self._digests


def _warm_save_pretrained(model: Any, log: Any) -> None:
    """A ``PreTrainedModel``'s first ``save_pretrained`` builds transformers' process-wide table of weight
    conversions (about 900 regular expressions: 0.8 s idle, 2.6 s under load, measured with transformers 5.x) before
    it writes a byte; a model made from its config (not ``from_pretrained``, which builds it while loading) would pay
    that inside a notice's seconds. Built here, once, at training start; nothing else changes."""
    if not hasattr(model, "save_pretrained") or getattr(model, "_weight_conversions", None) is not None:
        return
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415

        get_model_conversion_mapping(model, add_legacy=False)
    except Exception as exc:  # noqa: BLE001 - only a warm-up (another transformers version): the save builds it
        log.debug("save_pretrained warm-up skipped", error=repr(exc))


def _rounded(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in parts.items()}


def callback_states(tr: Any) -> list[tuple[str, Any]]:
    """(class name, a copy of ``state()``) of each stateful callback and the ``TrainerControl``, in the order
    ``_save_checkpoint`` reads them."""
    from transformers.trainer_callback import ExportableState  # noqa: PLC0415

    return [(cb.__class__.__name__, copy.deepcopy(cb.state()))
            for cb in tr.callback_handler.callbacks + [tr.control] if isinstance(cb, ExportableState)]


def _trainer_rng(rng: dict[str, Any], args: Any) -> dict[str, Any]:
    """A ``capture_rng`` dict in the form of ``Trainer._save_rng_state``'s file."""
    from transformers.training_args import ParallelMode  # noqa: PLC0415

    out: dict[str, Any] = {"python": rng["python"], "cpu": rng["torch"]}
    if "numpy" in rng:
        out["numpy"] = rng["numpy"]
    else:
        import numpy as np  # noqa: PLC0415

        out["numpy"] = np.random.get_state()
    if torch.cuda.is_available():  # not captured: CUDA not initialised, so its generators have not moved
        cuda = rng["cuda"] if "cuda" in rng else torch.cuda.get_rng_state_all()
        out["cuda"] = cuda if args.parallel_mode == ParallelMode.DISTRIBUTED else cuda[torch.cuda.current_device()]
    return out
