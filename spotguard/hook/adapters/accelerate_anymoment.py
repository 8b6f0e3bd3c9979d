"""Accelerate's any-moment path: a notice is agreed and written while the training thread goes on.

Why: on the boundary path a notice waits for the next ``optimizer.step()`` (the step
in flight: seconds, 10 s on a fine-tuning job) before anything is agreed, and then
``accelerator.save_state`` runs on the training thread. The Accelerate adapter
already runs on the plain hook's optimizer-step clock (``core.py``), so here the plain
hook's own any-moment machinery is reused unchanged — the agreement thread
(``agreement.py``: S = the last completed optimizer step), the hold of step S+1 at
its optimizer pre-hook, the background read of model and optimizer proven unchanged
since S (``watch.py``), the small state read at the anchor (``save.py``:
``_small_state``, ``_copy_at_anchor``), the commit and the exit — and only *how* S
is written differs: Accelerate's own files, so that ``accelerator.load_state`` (the
adapter's resume) is unchanged.

- **What cannot move** until the held step S+1: the prepared model's parameters and the
  optimizer's state (read off the training thread while the watch vouches for them,
  else at the training thread's next anchor: the core's exact fallback).
- **What moves between steps** is taken as at S's end: the RNG (python, numpy, torch,
  CUDA) from the snapshot of S's optimizer post-hook, the BatchNorm running statistics
  from the copy the first forward after S took (``_end_buffers``), and Accelerate's
  micro-batch counter ``accelerator.step`` as recorded at S's post-hook (it moves when
  the next ``accumulate()`` starts).
- **What the loop changes after the step** (the schedulers' state, ``lr`` in the
  optimizer's ``param_groups``) is read at the anchor (the first training forward after
  S), as the plain hook reads its schedulers.
- **How it is written**: ``save_state``'s files with those values — ``model.safetensors``
  (``accelerate.utils.save``, as ``save_accelerator_state``), ``optimizer.bin``,
  ``scheduler.bin``, ``random_states_<rank>.pkl`` (with ``step``), and the plain hook's ``rng_at_forward`` in
  ``spotguard_rng_at_forward_<rank>.pt`` (Accelerate ignores it; the resume realigns the torch RNG with it), and under DDP
  with ``broadcast_buffers=False`` each rank's own buffers of S in ``spotguard_buffers_<rank>.pt`` (``save_state`` writes
  rank 0's model only; the resume loads them after ``load_state``, on both paths), and rank 0's
  ``project_configuration.iteration`` as the first training forward after S found it in ``spotguard_iteration.json``
  (``save_state`` does not save it: the resumed run's own automatically named checkpoints go on from it; those the
  interrupted run wrote after S are replaced, ``accelerate_own.py``), the default shuffle's generator
  (``accelerate_sampler.py``) and, for schedulers stepped at the iteration's top, their state and ``lr`` as at S's
  optimizer step (``accelerate_sched.py``) — without
  ``save_state``: it reads the live RNG and ``accelerator.step`` and, for automatic
  checkpoint naming, runs ``wait_for_everyone()`` on the training group, which the
  background thread must never touch.

Gradient accumulation (``Accelerator(gradient_accumulation_steps=N)`` + ``accelerator.accumulate``,
``opt.step()``/``sched.step()`` called on every micro-batch or only when ``sync_gradients``): the clock
is the torch optimizer's step hooks inside ``AcceleratedOptimizer``, which calls ``step()`` only on a
micro-batch that syncs (and its scheduler wrapper steps only then), so S is the last optimizer step
that really ran; the micro-batches after it only add to ``.grad`` (not saved: zeroed at S) and move
the RNG, the running statistics and ``accelerator.step``, all taken as at S above (the anchor is the
first micro-batch's forward); they are thrown away and recomputed after the resume. While a round
writes S the next micro-batch's forward waits (``accelerate.py``: the core's hold, as at S+1's real
step; an agreed exit leaves from there). The micro-batch path
(``accelerate.py``: ``save_state`` at the next micro-batch's forward) stays for refused configurations.

Configurations not proven exact keep the boundary path, said once in the
``notice_path`` line (``any_moment_refusal``): FSDP / DeepSpeed / Megatron-LM / XLA, several
models or optimizers, a GradScaler (fp16), objects registered with
``register_for_checkpointing`` (their state is not proven read at S), a stateful or
``IterableDatasetShard`` data loader (its position moves between steps), save-state
pre-hooks, ``every=``, ``hook.range()`` / ``hook.step()`` loops (from their first boundary) and
``SPOTGUARD_BACKGROUND_AGREEMENT=0``.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..state import unpack
from .accelerate_own import replace_stale_own_checkpoints

__all__ = ["AccelerateAnyMoment", "any_moment_refusal", "RNG_AT_FORWARD", "RANK_BUFFERS", "save_rank_buffers",
           "ITERATION", "save_iteration"]

#: ``<this>_<rank>.pt``: the torch RNG at the first training forward after S (``_realign_at_load``)
RNG_AT_FORWARD = "spotguard_rng_at_forward"
#: ``<this>_<rank>.pt``: this rank's buffers of S where DDP does not broadcast them (``_realign_at_load``)
RANK_BUFFERS = "spotguard_buffers"
#: rank 0: ``project_configuration.iteration`` of S (the user's next automatically named ``checkpoint_<n>``)
ITERATION = "spotguard_iteration.json"


def any_moment_refusal(accelerator: Any, every: Optional[float]) -> Optional[str]:
    """None when this accelerator's ``save_state`` files can be written from the background exactly; else why not."""
    if os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT", "1").strip() == "0":
        return "SPOTGUARD_BACKGROUND_AGREEMENT=0"
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", accelerator.distributed_type))
    if kind.upper() in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
        return f"distributed type {kind}: its checkpoint is written by collectives on the training group"
    if len(getattr(accelerator, "_models", [])) != 1 or len(getattr(accelerator, "_optimizers", [])) != 1:
        return "not exactly one prepared model and one optimizer"
    if getattr(accelerator, "scaler", None) is not None:
        return "a GradScaler (fp16): its update() is not proven an iteration's end"
    if getattr(accelerator, "_custom_objects", None):
        return ("objects registered with register_for_checkpointing: their state is not proven to be read as at "
                "the end of the agreed step")
    for dl in getattr(accelerator, "_dataloaders", []):
        if getattr(dl, "use_stateful_dataloader", False) or type(getattr(dl, "dataset", None)).__name__ == \
                "IterableDatasetShard":
            return "a stateful / IterableDatasetShard data loader: its saved position moves between steps"
    if getattr(accelerator, "_save_model_state_pre_hook", None):
        return "save_state pre-hooks: they run inside save_state, on the training thread"
    if every is not None:
        return "every=: the periodic checkpoint is written by save_state at the step boundary"
    return None


def _unbroadcast_buffers(accelerator: Any) -> bool:
    """DDP told not to broadcast the buffers from rank 0 (``DistributedDataParallelKwargs(broadcast_buffers=False)``;
    ``_models`` holds the unwrapped module) around a model with buffers: each rank's own."""
    handler = getattr(accelerator, "ddp_handler", None)
    if getattr(handler, "broadcast_buffers", True) is not False or int(getattr(accelerator, "num_processes", 1)) < 2:
        return False
    return any(isinstance(m, torch.nn.Module) and next(m.buffers(), None) is not None
               for m in getattr(accelerator, "_models", []))


def save_rank_buffers(accelerator: Any, folder: Path, state: dict[str, Any]) -> None:
    """DDP with ``broadcast_buffers=False`` (each rank's BatchNorm statistics its own; ``save_state`` writes rank
    0's model only): this rank's persistent buffers of the prepared model, taken from ``state`` (its state-dict
    keys, as of the saved step), beside Accelerate's files."""
    if not _unbroadcast_buffers(accelerator):
        return
    names = [n for n, _ in accelerator._models[0].named_buffers() if n in state]
    torch.save({n: state[n].detach().clone() for n in names}, folder / f"{RANK_BUFFERS}_{accelerator.process_index}.pt")


def save_iteration(accelerator: Any, folder: Path, iteration: Optional[int]) -> None:
    """Rank 0: Accelerate's count of the user's own ``save_state`` calls as of the saved step (``save_state`` does
    not save it; the resumed run's next automatically named checkpoint would be ``checkpoint_0`` again)."""
    if accelerator.process_index == 0 and isinstance(iteration, int):
        (folder / ITERATION).write_text(json.dumps({"iteration": iteration}))


def _iteration(accelerator: Any) -> Optional[int]:
    it = getattr(getattr(accelerator, "project_configuration", None), "iteration", None)
    return it if isinstance(it, int) else None


class AccelerateAnyMoment:
    """Part of ``AccelerateHook`` (``accelerate.py``), before ``FrameworkHook`` in its bases (module docstring)."""

    accelerator: Any
    _acc_why: Optional[str] = "not decided"
    _acc_step: Optional[tuple[int, int]]
    _rank: int
    _world: int
    _watch: Any
    _every: Optional[float]
    _write_into: Callable[..., None]
    _loop: Any  # loopshape.LoopShape
    _book: Any  # stepbook.StepBook
    _log_path: Callable[[str, str, str], None]
    _enter_explicit: Callable[[], None]
    _gens: Any  # accelerate_sampler.SamplerGenerators
    _tops: Any  # accelerate_sched.TopSchedulers

    def _any_moment_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Decide the path (before the core is armed); on the any-moment path the core's dict also holds the
        inner schedulers, so that the core reads their state at the anchor as the plain hook's."""
        self._acc_why = any_moment_refusal(self.accelerator, self._every)
        if self._acc_why is None:
            for i, s in enumerate(getattr(self.accelerator, "_schedulers", [])):
                state[f"scheduler{i}"] = getattr(s, "scheduler", s)
        return state

    def _why_not_background(self) -> Optional[str]:  # core.Hook: creates the agreement thread when None
        if self._acc_why is not None:
            return f"{self._acc_why} (the boundary path: a notice is acted on at the next optimizer step)"
        self._background_capable = True  # type: ignore[misc] - this instance: its files are written here
        return super()._why_not_background()  # type: ignore[misc]

    def _begin_explicit(self, loop: str, start: int) -> None:  # core: hook.range() / the first hook.step()
        """An explicit loop keeps the boundary path (said once): this writer is not proven on the core's clocked
        path, whose boundaries read the small state."""
        if self._loop.explicit or self._loop.range_clock:
            return
        self._log_path("boundary", loop, f"{loop} with Accelerate: the any-moment writer is proven for the "
                                         "implicit loop only; the loop's boundary acts")
        self._enter_explicit()

    def _tensor_state(self) -> dict[str, Any]:
        """The prepared model's and the torch optimizer's own state dicts (``save_state``'s keys: a DDP model's
        ``module.`` prefix kept), not DCP's FQN form: they are written as Accelerate writes them."""
        acc = self.accelerator
        return {"model0": acc._models[0].state_dict(),
                "optimizer0": getattr(acc._optimizers[0], "optimizer", acc._optimizers[0]).state_dict()}

    def _per_rank_state(self, step: int, snap: Any) -> dict[str, Any]:
        """The core's per-rank state of ``step`` (read at its anchor) and ``accelerator.step`` as recorded at that
        step's optimizer post-hook: an ordinary checkpoint is written after training went on past it."""
        per = super()._per_rank_state(step, snap)  # type: ignore[misc]
        if self._acc_step is not None and self._acc_step[0] == step:
            per["accelerator_step"] = self._acc_step[1]
        per["accelerator_iteration"] = self._iteration_of(step)
        per["sampler_generators"] = self._gens.of(step)
        top = self._tops.of(step)
        if top is not None:  # stepped at the iteration's top: as at S's optimizer step (accelerate_sched.py)
            per["schedulers"] = {f"scheduler{i}": st for i, st in enumerate(top[0])}
        return per

    def _capture_small(self, step: int, where: str) -> tuple[Any, ...]:
        """The core's small state of ``step``; the optimizer's param_groups as at its optimizer step when the
        schedulers are stepped at the iteration's top (``lr`` written there for the next iteration)."""
        out = super()._capture_small(step, where)  # type: ignore[misc]
        return self._top_groups(step, out)

    def _copy_small(self, step: int, where: str) -> tuple[Any, ...]:
        out = super()._copy_small(step, where)  # type: ignore[misc]
        return out if out[1] is None else self._top_groups(step, out)

    def _top_groups(self, step: int, out: tuple[Any, ...]) -> tuple[Any, ...]:
        top = self._tops.of(step)
        return out if top is None else (out[0], out[1], {"optimizer0": top[1][0]}, out[3])

    def _iteration_of(self, step: int) -> Optional[int]:
        """``project_configuration.iteration`` at the end of ``step``: as the first training forward after it
        found it (the user's own ``save_state`` later in the accumulation is not part of ``step``), else now."""
        at = getattr(self, "_iter_at", None)
        return at[1] if at is not None and at[0] == step else _iteration(self.accelerator)

    def _dcp_save(self, sd: dict[str, Any], key: str, group: Any, cancel: Any) -> None:
        """The core's write of the staged save (``_dcp_writer``: checked against the watch after it when written
        from live tensors): Accelerate's files of S instead of ``dcp.save``, no collective."""
        per = unpack(sd[self._rank_key(self._rank)])  # type: ignore[attr-defined]
        self._write_into(key, lambda target: self._acc_files(target, sd, per))

    def _acc_files(self, target: str, sd: dict[str, Any], per: dict[str, Any]) -> None:
        """``save_state``'s files of step ``per["step"]`` into ``target``: rank 0 the shared ones, every rank its
        ``random_states_<process_index>.pkl``."""
        from accelerate.utils import save  # noqa: PLC0415

        acc, step, out = self.accelerator, int(per["step"]), Path(target)
        out.mkdir(parents=True, exist_ok=True)
        if "accelerator_step" not in per:
            raise RuntimeError(f"accelerator.step of step {step} was not recorded at its optimizer step")
        model = OrderedDict(sd["model0"])  # an OrderedDict: save() drops shared tensors for safetensors then
        for name, t in per["buffers"].get("model0", {}).items():  # BatchNorm statistics as at S's end
            if name in model:
                model[name] = t
        if acc.process_index == 0:
            save(model, out / "model.safetensors", safe_serialization=True)
            save(sd["optimizer0"], out / "optimizer.bin")
            for i in range(len(getattr(acc, "_schedulers", []))):
                save(per["schedulers"][f"scheduler{i}"], out / ("scheduler.bin" if i == 0 else f"scheduler_{i}.bin"))
        save_rank_buffers(acc, out, model)
        save_iteration(acc, out, per.get("accelerator_iteration"))
        self._gens.write(out, acc.process_index, per.get("sampler_generators") or {})
        rng = per["rng"]
        states: dict[str, Any] = {"step": per["accelerator_step"], "random_state": rng["python"],
                                  "numpy_random_seed": rng["numpy"], "torch_manual_seed": rng["torch"]}
        if torch.cuda.is_available():
            # S's (captured once CUDA is initialised); before that the generators are untouched: as save_state reads
            states["torch_cuda_manual_seed"] = rng["cuda"] if "cuda" in rng else torch.cuda.get_rng_state_all()
        torch.save(states, out / f"random_states_{acc.process_index}.pkl")
        if isinstance(per.get("rng_at_forward"), torch.Tensor):  # not Accelerate's: _realign_at_load reads it
            torch.save(per["rng_at_forward"], out / f"{RNG_AT_FORWARD}_{acc.process_index}.pt")

    def _realign_at_load(self, folder: str) -> None:
        """After ``load_state``: this rank's torch RNG at the interrupted run's first training forward after S,
        when the writer above saved it, for ``stephooks._realign_rng`` (the plain hook's ``rng_at_forward``): the
        Accelerate docs' mid-epoch resume, ``skip_first_batches``, builds a DataLoader iterator that draws a base
        seed from the global torch RNG, which the uninterrupted run drew at the epoch's start, before S."""
        f = Path(folder) / f"{RNG_AT_FORWARD}_{self._rank}.pt"
        saved = torch.load(f, weights_only=True) if f.is_file() else None
        self._book.realign_to(saved if isinstance(saved, torch.Tensor) else None)
        f, cfg = Path(folder) / ITERATION, getattr(self.accelerator, "project_configuration", None)
        if f.is_file() and cfg is not None:  # after load_state (and _explicit_dirs, which puts the old one back)
            cfg.iteration = int(json.loads(f.read_text())["iteration"])
            replace_stale_own_checkpoints(self.accelerator, cfg.iteration, lambda: self._log)  # type: ignore
        self._gens.load(Path(folder), self.accelerator.process_index)
        self._tops.rebase()
        f = Path(folder) / f"{RANK_BUFFERS}_{self.accelerator.process_index}.pt"
        if f.is_file():  # save_rank_buffers: load_state put rank 0's into every rank
            mine, live = torch.load(f, weights_only=True), dict(self.accelerator._models[0].named_buffers())
            with torch.no_grad():
                for name, t in mine.items():
                    if name in live:
                        live[name].copy_(t)
