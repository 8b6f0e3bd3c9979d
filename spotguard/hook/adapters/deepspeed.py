"""DeepSpeed ``DeepSpeedEngine`` adapter (ZeRO stages 0-3, with or without optimizer offload).

Install after ``deepspeed.initialize(...)``, on every rank::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=net, config=cfg)
    hook = install_preemption_hook(engine, storage="s3://bucket/run")
    start = hook.resume()          # engine.load_checkpoint(<newest committed>) -> engine.global_steps, 0 if none

The user's loop (``loss = engine(x)``, ``engine.backward(loss)``, ``engine.step()``)
stays as it is. DeepSpeed owns the optimizer step (ZeRO's partitioned update, the
all-gather of the updated parameters, the scheduler) and its step counter,
``engine.global_steps``, which advances only at a gradient-accumulation boundary.

Two ways to act on a notice (which one: the ``notice_path`` log line, once):

- **At any moment** (ZeRO-2/3 without offload or gradient accumulation:
  ``deepspeed_anymoment.py``): the agreement runs on a background thread and writes
  the last completed ``engine.step()`` while the forward/backward in flight goes on;
  the next ``engine.step()`` is held until that step is written.
- **At the step boundary** (every other configuration): after every ``engine.step()`` that advanced
  ``global_steps`` the hook launches the agreement and reads it at once
  (``_framework_boundary``: not at the next step, as the other framework adapters do);
  an agreed notice is written right there: model, ZeRO-partitioned optimizer and
  scheduler are exactly those of step S, and the RNG, the ``hook.add_state`` loaders
  and the engine's counters are those of the end of S. With other ``add_state``
  objects (an EMA updated after ``engine.step()``, a meter) the boundary of S moves to
  the *anchor* of iteration S+1, the engine's next training forward (grad enabled),
  where the loop's post-step work is over: they are read there, the RNG and loaders
  as copied at S's ``engine.step()``; a job whose loop ends after S acts on it in
  ``destroy_process_group()``.

Gradient accumulation (boundary path): a notice is acted on at the next accumulation
boundary, never between micro-batches. Why: ZeRO keeps the partly reduced
gradients of the micro-batches since S in its own buffers (``ipg`` buckets,
``averaged_gradients``), which ``save_checkpoint`` does not write, and
DeepSpeed has no public way to put them back: at the boundary is the only
point where its checkpoint is exact. The deadline estimate counts a whole
accumulation as one iteration.

How the bytes go (boundary path; the any-moment path writes the same files from the engine's state-dict
functions): ``engine.save_checkpoint`` runs with a spotguard
``CheckpointEngine`` (DeepSpeed's pluggable writer, ``deepspeed_files.py``) for the duration of the save.
Each file DeepSpeed ``torch.save``s (``mp_rank_00_model_states.pt`` on rank 0,
every rank's ``*zero_pp_rank_<r>_*`` files) is streamed into ``<storage>/step-N/``
- an object store's multipart upload, or the local folder - with its checksum
taken as it goes, so nothing is staged whole on local disk and the commit record
names exactly what the ranks wrote. Each rank adds ``spotguard_rank<r>.pt`` (RNG,
``add_state`` objects). Rank 0 commits as for every checkpoint (same
protocol, checksums, quarantine, lineage).

Resume: the newest committed checkpoint that verifies (a damaged one is
quarantined and the previous one is used), loaded with
``engine.load_checkpoint`` through the same engine: its files load with
``torch.load(weights_only=True)`` and an allowlist of the few DeepSpeed types
its optimizer state holds (``ZeroStageEnum``, ``LossScaler``, ...), never as
arbitrary pickles. Refused at install: NVMe optimizer offload and ``checkpoint.load_universal``
(``_refuse_unsupported``). Another world size is refused (``DeepSpeedWorldSizeChanged``):
ZeRO's partitions are cut for the world size that wrote them, and DeepSpeed's
own reshaping (universal checkpoints) needs its offline conversion.
"""

from __future__ import annotations

import os
import shutil
import weakref
from typing import Any, Callable, Mapping, Optional

import torch

from ...storage import Storage
from ...storage.base import join_key
from ...storage.integrity import DamagedCheckpoint
from ...storage.verify import verified_folder
from ..core import Hook
from ..state import capture_rng, copy_state, pack, restore_rng, unpack
from ._base import FrameworkHook
from ._files import staging_dir
from .deepspeed_anymoment import AnyMomentMixin
from .deepspeed_files import (DeepSpeedWorldSizeChanged, SpotguardCheckpointEngine, check_world,
                              refuse_other_world, swapped)

__all__ = ["DeepSpeedHook", "DeepSpeedWorldSizeChanged", "SpotguardCheckpointEngine", "check_world", "install",
           "refuse_other_world", "swapped"]

_TAG = "ds"  # DeepSpeed's tag folder inside the throw-away save_dir: file names are taken relative to it

_FOLLOWERS: "weakref.WeakKeyDictionary[Any, Callable[[Any], None]]" = weakref.WeakKeyDictionary()
_FOLLOWED_CLASSES: dict[type, type] = {}


def _followed_class(cls: type) -> type:
    """``cls`` with a ``step()`` that tells the hook following the instance, if any.

    A subclass swapped in as the instance's ``__class__`` rather than an instance attribute over ``step``: a torch
    scheduler's ``state_dict()`` is its ``__dict__``, so an attribute there would end up in every checkpoint of
    it (the user's own too) and could not be pickled."""
    sub = _FOLLOWED_CLASSES.get(cls)
    if sub is None:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.step(self, *args, **kwargs)  # type: ignore[attr-defined]
            cb = _FOLLOWERS.get(self)
            if cb is not None:
                cb(self)
            return out

        sub = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _FOLLOWED_CLASSES[cls] = sub
    return sub


class _Followed:
    """A scheduler whose ``step()`` calls ``cb`` until ``remove()`` (kept with the hook's other handles)."""

    def __init__(self, sched: Any, cb: Callable[[Any], None]) -> None:
        self._sched, self._cls = sched, type(sched)
        sched.__class__ = _followed_class(self._cls)
        _FOLLOWERS[sched] = cb

    def remove(self) -> None:
        _FOLLOWERS.pop(self._sched, None)
        self._sched.__class__ = self._cls


def _refuse_unsupported(engine: Any) -> None:
    """Configurations whose checkpoint spotguard's CheckpointEngine would not hold whole, or would not read safely."""
    if _flag(engine, "zero_nvme_offload_optimizer"):
        raise NotImplementedError(
            "DeepSpeed optimizer offload to nvme is not supported by spotguard yet: save_checkpoint copies the swap "
            "folder with shutil, outside the CheckpointEngine, so the committed checkpoint would lack the optimizer "
            "state; offload the optimizer to cpu instead")
    if _flag(engine, "load_universal_checkpoint"):
        raise NotImplementedError(
            "DeepSpeed's checkpoint.load_universal is set: engine.load_checkpoint would then read spotguard's "
            "checkpoint as a universal one (another layout, loaded with torch.load(weights_only=False)); unset it "
            "for the job spotguard resumes")


def _flag(engine: Any, name: str) -> bool:
    fn = getattr(engine, name, None)
    return bool(fn()) if callable(fn) else False



class DeepSpeedHook(AnyMomentMixin, FrameworkHook):
    framework = "deepspeed"
    _read_at_boundary = True  # the agreement is read at the engine.step() that launched it (FrameworkHook._read_now)

    # The loop is the user's: the plain hook's resume applies (FrameworkHook forbids it).
    range = Hook.range

    def __init__(self, engine: Any, storage: str | Storage | None = None, *, socket: str | None = None,
                 keep: int | None = None, exit_code: int = 143, on_notice: Optional[Callable[..., Any]] = None,
                 every: Optional[float] = None) -> None:
        if type(engine).__name__ == "PipelineEngine":
            raise NotImplementedError("DeepSpeed pipeline parallelism (PipelineEngine.train_batch) is not supported "
                                      "by spotguard yet; a DeepSpeedEngine with ZeRO stages 0-3 is")
        _refuse_unsupported(engine)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("install_preemption_hook(engine) goes after deepspeed.initialize(...), which sets up "
                               "torch.distributed")
        super().__init__(storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice, arm=False,
                         every=every)
        self.engine = engine
        self._extra: dict[str, Any] = {}
        self._outside: list[Any] = []  # follow_schedulers(), add_state(<a torch scheduler>)
        self._stepped: set[int] = set()  # those of _outside stepped since the last engine.step()
        # (step, RNG, loaders at engine.step()) whose boundary waits for a followed scheduler or the next anchor
        self._after_sched: Optional[tuple[int, dict[str, Any], dict[str, Any]]] = None
        self._rng_at: Optional[dict[str, Any]] = None
        self._loaders_at: Optional[dict[str, Any]] = None  # loaders as at engine.step(), for a deferred boundary
        self._anchor_hook = False  # the engine's forward pre-hook serving a deferred boundary is registered
        self._ds_any = False  # the any-moment path (deepspeed_anymoment.py); set when the core arms
        self._ds_small = None  # (step, RNG, add_state objects, buffers, error) at the last engine.step()'s end
        self._ds_buffers: list[str] = list(engine._get_buffer_names())
        self._arm({})
        self._ds_announce()
        self._wrap_step()
        self._log.info("deepspeed_installed", zero_stage=int(engine.zero_optimization_stage()),
                       offload_optimizer=bool(engine.zero_offload_optimizer()) if hasattr(
                           engine, "zero_offload_optimizer") else None,
                       gradient_accumulation_steps=int(engine.gradient_accumulation_steps()),
                       acts_at="any moment (the last completed engine.step())" if self._ds_any else
                       "the engine's accumulation boundary (engine.step() advancing global_steps)",
                       elastic="refused: a ZeRO checkpoint resumes only on the world size that wrote it "
                               f"({self._world})")

    # ------------------------------------------------------------------ public

    def add_state(self, key: str, obj: Any) -> None:
        """Save and restore ``obj`` (``state_dict``/``load_state_dict``) with every checkpoint, per rank: a loader
        or sampler (iterable) as it is at the end of ``engine.step()``; anything else (an EMA, a meter) as it is
        at the next iteration's anchor, the engine's first training forward after the step (the loop's post-step
        work is over). Call before ``resume()`` on every rank."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"add_state({key!r}, ...) needs an object with state_dict() and load_state_dict()")
        self._extra[key] = obj
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and obj is not getattr(self.engine, "lr_scheduler",
                                                                                         None):
            self._follow(obj)  # the loop steps it after engine.step(): save it as it is after that step
        elif key in self._anchored():
            self._watch_anchor()
            if self._every is not None:  # the any-moment path's periodic save runs at engine.step()'s end
                self._ds_leave("every= with an add_state object read at the next iteration's anchor (an EMA, a "
                               "meter): the periodic checkpoint is taken at that anchor, on the boundary path")

    def resume(self) -> int:
        """``Hook.resume`` (newest committed, damaged ones skipped, loaded by ``engine.load_checkpoint``);
        returns the engine's step (``global_steps``), 0 if none."""
        self._warn_unsaved_loader()
        step = Hook.resume(self)
        self._last_boundary = step
        return step

    def _warn_unsaved_loader(self) -> None:
        """``deepspeed.initialize(training_data=...)``: its ``DeepSpeedDataLoader`` has no ``state_dict`` and a plain
        ``DistributedSampler``, so nothing saves its position; without any ``add_state`` object that could, a
        resume starts its epoch over (not exact), and the user learns it here rather than from the losses."""
        loader = getattr(self.engine, "training_dataloader", None)
        if loader is None or self._extra or callable(getattr(loader, "state_dict", None)):
            return
        self._log.warning("deepspeed_data_position_not_saved", loader=type(loader).__name__,
                          why="the engine's DeepSpeedDataLoader (deepspeed.initialize(training_data=...)) keeps its "
                              "position nowhere a checkpoint can save: a resume starts its epoch over",
                          fix="a loader with state_dict/load_state_dict, or the sampler of your own DataLoader "
                              "(spotguard.data.ElasticDistributedSampler; sampler.attach(loader) if it has "
                              "workers), given to hook.add_state(...) before resume()")

    # ------------------------------------------------------------------ the boundary

    def _wrap_step(self) -> None:
        """``engine.step()`` then the boundary, when it advanced ``global_steps`` (micro-batches: nothing)."""
        engine, orig, hook = self.engine, self.engine.step, self

        def step(*args: Any, **kwargs: Any) -> Any:
            if hook._ds_any and not (hook._life.closed or hook._internal or hook._life.torn_down):
                return hook._ds_step(orig, args, kwargs)
            out = orig(*args, **kwargs)
            if not (hook._life.closed or hook._internal):
                if hook._outside or hook._anchored():  # the boundary waits: a scheduler's step, the next anchor
                    hook._after_sched = (int(engine.global_steps), capture_rng(), hook._loader_copies())
                    hook._stepped = set()
                else:
                    hook._framework_boundary(int(engine.global_steps))
            return out

        engine.step = step
        self._book.shadow(engine, "step")

    def follow_schedulers(self, schedulers: list[Any]) -> None:
        """Schedulers the loop steps itself after ``engine.step()`` (Accelerate's wrapper around a torch scheduler
        DeepSpeed does not own; a torch scheduler given to ``add_state`` is followed by itself): saved with every
        checkpoint, and the boundary moves to the end of the step() that steps the last of them (else the
        checkpoint would hold them one step behind), with the RNG as at ``engine.step()``. A step without a
        scheduler step: the next training forward of the engine is the boundary (always, when ``add_state``
        holds objects read at the anchor)."""
        for i, sched in enumerate(schedulers):
            self._extra[f"scheduler{i}"] = sched
            self._follow(sched)

    def _follow(self, sched: Any) -> None:
        if any(s is sched for s in self._outside):
            return
        self._ds_leave("a scheduler the loop steps after engine.step() (follow_schedulers, add_state): the step's "
                       "end is where the last of them stepped")
        self._outside.append(sched)
        self._book.keep(_Followed(sched, self._sched_stepped))
        self._watch_anchor()

    def _watch_anchor(self) -> None:
        """The engine's training forwards serve a deferred boundary (registered once)."""
        if not self._anchor_hook:
            self._anchor_hook = True
            self._book.keep(self.engine.register_forward_pre_hook(
                lambda *_: self._pending_boundary() if torch.is_grad_enabled() else None))

    def _sched_stepped(self, sched: Any) -> None:
        self._stepped.add(id(sched))
        if len(self._stepped) >= len(self._outside) and not self._anchored():
            self._pending_boundary()

    def _loader_copies(self) -> dict[str, Any]:
        return {k: copy_state(self._extra[k].state_dict()) for k in self._ds_loaders()}

    def _pending_boundary(self) -> None:
        pending, self._after_sched = self._after_sched, None
        if pending is None or self._life.closed or self._internal:
            return
        self._rng_at, self._loaders_at = pending[1], pending[2]
        try:
            self._framework_boundary(pending[0])
        finally:
            self._rng_at = self._loaders_at = None

    def _quiesce(self) -> None:  # exit.py, in destroy_process_group() (every rank)
        """The loop is over: a boundary still waiting for an anchor that will not come is taken here."""
        if not (self._life.torn_down or self._life.exiting):
            self._pending_boundary()
        super()._quiesce()

    # ------------------------------------------------------------------ state <-> DeepSpeed

    def _swapped(self, ce: SpotguardCheckpointEngine) -> Any:
        return swapped(self.engine, ce)

    def _write(self, key: str, snap: Any) -> None:
        """Every rank: DeepSpeed's own save, each file streamed to ``key``; then this rank's spotguard file."""
        state = {k: o.state_dict() for k, o in self._extra.items()}
        state.update(self._loaders_at or {})  # a deferred boundary: the loaders as at engine.step()
        per = pack({"rng": self._rng_at or capture_rng(), "state": state, "step": self._steps.count,
                    "world_size": self._world})
        tmp = staging_dir(f"deepspeed-{self._rank}")  # receives only DeepSpeed's recovery scripts (rank 0)
        try:
            ce = SpotguardCheckpointEngine(self._storage, key, os.path.join(tmp, _TAG))
            with self._swapped(ce):
                self.engine.save_checkpoint(str(tmp), tag=_TAG, save_latest=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._storage.write_bytes(join_key(key, f"spotguard_rank{self._rank}.pt"), per)

    def _check_world(self, dirkey: str) -> None:
        check_world(self._storage, dirkey, self._world)

    def _load(self, dirkey: str, digests: Any = None) -> Optional[DamagedCheckpoint]:
        """Every rank: verify (or download verified), agree, then ``engine.load_checkpoint``; damage is returned."""
        self._check_world(dirkey)
        damage: Optional[DamagedCheckpoint] = None
        folder = None
        try:
            folder = verified_folder(self._storage, dirkey, self._log)
            per = unpack((folder / f"spotguard_rank{self._rank}.pt").read_bytes(),
                         f"{self._storage.uri}/{dirkey}/spotguard_rank{self._rank}.pt")
        except FileNotFoundError as exc:
            damage = DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", f"missing: {exc}")
        except DamagedCheckpoint as exc:
            damage = exc
        if not self._all_ok(damage is None):
            return damage or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank found it damaged")
        assert folder is not None
        # DeepSpeed reads <load_dir>/<tag>/...: the committed folder is the tag, its parent the load_dir
        stage = staging_dir(f"deepspeed-load-{self._rank}")
        try:
            os.symlink(folder, stage / _TAG)
            ce = SpotguardCheckpointEngine(self._storage, dirkey, str(stage / _TAG))
            with self._swapped(ce):
                path, _client = self.engine.load_checkpoint(str(stage), tag=_TAG, load_optimizer_states=True,
                                                            load_lr_scheduler_states=True)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {self._storage.uri}/{dirkey}")
        self._restore_rank(per)
        return None

    def _restore_rank(self, per: Mapping[str, Any]) -> None:
        """This rank's objects and RNG, as at the end of the saved step (the RNG last: nothing may draw after it)."""
        states = per.get("state", {})
        for key, obj in self._extra.items():
            if key in states:
                obj.load_state_dict(states[key])
            else:
                self._log.warning("stateful object not in the checkpoint", key=key)
        engine = self.engine
        engine.micro_steps = int(engine.global_steps) * int(engine.gradient_accumulation_steps())
        restore_rng(per.get("rng", {}))


def install(engine: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> DeepSpeedHook:
    return DeepSpeedHook(engine, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                         every=every)
