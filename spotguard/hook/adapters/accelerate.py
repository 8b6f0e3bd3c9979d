"""``accelerate.Accelerator`` adapter: the plain hook's boundaries, Accelerate's checkpoint format.

Install after ``accelerator.prepare(...)`` (the hook needs the prepared
optimizers), on every process::

    model, opt, sched = accelerator.prepare(model, opt, sched)
    hook = install_preemption_hook(accelerator, storage="s3://bucket/run")
    start = hook.resume()          # accelerator.load_state(<newest committed>) -> its step, 0 if none

The user's loop stays as it is. With one model and one optimizer (DDP or one
process; gradient accumulation or not) a notice is acted on **at any moment**, as the
plain hook's: the last completed optimizer step S is written from the
background in ``save_state``'s files while step S+1 goes on (held before its
optimizer step): ``accelerate_anymoment.py``; measured notice -> committed p50 /
p99 0.42 / 0.52 s with 64 MiB and 10 s steps (the boundary path: 16.8 / 19.0 s; with accumulation 8
of 1.25 s: 0.83 / 1.52 s at load 9-15). Where
that path refuses (FSDP, DeepSpeed, a GradScaler, custom objects,
...: said in ``notice_path``), the boundary path below. On it, exactly like
the plain-PyTorch hook's boundary path (same code): the ranks decide at each
real ``optimizer.step()`` (the post-hook of the torch optimizer inside
Accelerate's wrapper, so gradient-accumulation
micro-steps, where Accelerate skips the step, never count), launching the
flag's all-reduce on the hook's own gloo group; at the next step's pre-hook
(the end of the deciding iteration: the scheduler has stepped) the reduction
is waited and, if any rank asked, ``accelerator.save_state`` writes the
checkpoint on every process into ``<storage>/step-N/`` (directly for a local
store, via a staging folder + upload for an object store), with the RNG
states and normalisation-layer running statistics put back to what they were
right after the deciding step, and Accelerate's micro-batch counter
(``accelerator.step``) and the schedulers' ``_step_count`` as they were at that
step. Rank 0 commits, every rank tears down and raises ``Preempted`` (exit
143). ``hook.step()`` / ``hook.range(total)`` give an explicit boundary
instead, as for the plain hook.

Gradient accumulation (``gradient_accumulation_steps`` > 1) on the boundary path
(the any-moment path writes the last real step from the background instead): the next real
step can be many micro-batches away (8 of 1 s and a 6 s notice: past the
deadline). So each training forward of the prepared model that is not the
first since the last optimizer step (every rank forwards as often) also
collects and launches the agreement (``FrameworkHook._framework_microbatch``),
and an agreed notice is carried out right there, ``save_state`` rewound to the
last optimizer step as above; the micro-batches since are recomputed after the
resume. Without accumulation nothing changes: the next optimizer step is the
next batch's. With ``even_batches=False`` the ranks' epochs may differ in
micro-batches (an agreement launched at one rank's extra forward pairs with
none: a hang), so there a notice waits for the next optimizer step.

Data position: Accelerate's ``save_state`` saves no position inside the epoch
(for a map-style dataset the default shuffle's generator, ``use_seedable_sampler=False``,
is saved by the adapter: ``accelerate_sampler.py``); ``start`` counts optimizer steps, and
Accelerate syncs at the loader's last batch, so an epoch is
``spe = ceil(len(loader) / N)`` steps: continue in epoch ``start // spe`` with
``accelerator.skip_first_batches(loader, (start % spe) * N)`` (or a
``use_stateful_dataloader`` loader, whose position is saved as it is at the
save, not rewound), as the Accelerate docs describe. That iterator draws a base seed from the global torch
RNG, which the uninterrupted run drew at the epoch's start: the torch RNG at the
first training forward after S is saved beside Accelerate's files
(``spotguard_rng_at_forward_<rank>.pt``) and set back there after the resume
(``stephooks._realign_rng``, logged ``rng_realigned``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ...storage import Storage
from ..core import Hook
from ..state import Snapshot, rng_and_buffers_at
from ._base import FrameworkHook
from .accelerate_sampler import SamplerGenerators
from .accelerate_sched import TopSchedulers
from .accelerate_anymoment import RNG_AT_FORWARD, AccelerateAnyMoment, _iteration, save_iteration, save_rank_buffers
from ...storage.integrity import DamagedCheckpoint
from ...storage.verify import verified_folder
from ._files import report_local, staging_dir, upload_dir

__all__ = ["AccelerateHook", "install"]

_RANK_FILE = re.compile(r"^(?:random_states_(\d+)\.pkl"  # one a rank
                        r"|spotguard_(?:rng_at_forward|buffers|sampler_generators)_(\d+)\.pt)$")


def _nothing() -> None:
    """``_step_begin``'s ``enter`` at a micro-batch's forward: past the hold, nothing is marked (not a step)."""


def _prepared_state(accelerator: Any) -> dict[str, Any]:
    """``{"model0": ..., "optimizer0": <torch optimizer inside the wrapper>, ...}`` for the step hooks."""
    state: dict[str, Any] = {}
    for i, m in enumerate(getattr(accelerator, "_models", [])):
        state[f"model{i}"] = m
    for i, o in enumerate(getattr(accelerator, "_optimizers", [])):
        state[f"optimizer{i}"] = getattr(o, "optimizer", o)
    return state


class AccelerateHook(AccelerateAnyMoment, FrameworkHook):
    framework = "accelerate"

    # The loop is the user's: the plain hook's resume/range apply (FrameworkHook forbids them).
    resume = Hook.resume
    range = Hook.range

    def __init__(self, accelerator: Any, storage: str | Storage | None = None, *, socket: str | None = None,
                 keep: int | None = None, exit_code: int = 143, on_notice: Optional[Any] = None,
                 every: Optional[float] = None) -> None:
        state = _prepared_state(accelerator)
        if not any(k.startswith("optimizer") for k in state):
            raise TypeError(
                "install_preemption_hook(accelerator) needs the prepared optimizer: call it after "
                "accelerator.prepare(model, optimizer, ...)"
            )
        super().__init__(storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice, arm=False,
                         every=every)
        self.accelerator = accelerator
        # Gradient accumulation: Accelerate's micro-batch counter (``accelerator.step``, saved by save_state,
        # deciding which micro-batch syncs) as it was at the last optimizer step, for a save between micro-batches
        self._acc_step: Optional[tuple[int, int]] = None
        self._mb_seq = -1  # _book.post_seq at the last training forward of the prepared model
        # ... and each scheduler's _step_count, which Accelerate bumps on every micro-batch that does not sync
        # when its gradient state says adjust_scheduler (never in 1.15: the plugin drops the default True from its
        # kwargs): as at the end of the step (the first forward after it)
        self._sched_at: Optional[tuple[int, list[tuple[Any, int]]]] = None
        # ... and project_configuration.iteration there (the user's own save_state calls so far): saved beside
        # Accelerate's files, which lack it, so that the resumed run's automatically named checkpoints go on
        self._iter_at: Optional[tuple[int, Optional[int]]] = None
        # the torch RNG at the first training forward after each step, saved beside save_state's files for the
        # resume's realign (``_realign_at_load``): the any-moment writer has the core's ``rng_at_forward``
        self._acc_fwd_rng: Optional[tuple[int, torch.Tensor]] = None
        # the default shuffle's generator (use_seedable_sampler=False), which save_state does not save
        self._gens = SamplerGenerators(accelerator)
        self._rewinding = False
        self._tops = TopSchedulers(accelerator, lambda: self._log)  # a scheduler stepped at the iteration's top
        self._signal_model = state.get("model0")
        self._arm(self._any_moment_state(state))

    # ------------------------------------------------------------- gradient accumulation

    def resume(self) -> int:
        """``Hook.resume``; then the state right after the load stands for the resumed step (a notice in the
        first accumulation after the resume is acted on between micro-batches as well)."""
        step = Hook.resume(self)
        if self._steps.count > 0:
            self._state_at.record_snap(Snapshot.take(self._objs.loaders), self._steps.count)
            self._acc_step = (self._steps.count, int(self.accelerator.step))
        return step

    def _decide(self) -> None:
        super()._decide()
        self._acc_step = (self._steps.count, int(self.accelerator.step))
        self._gens.step(self._steps.count)
        self._tops.step(self._steps.count)

    def _on_forward(self, module: Any, args: Any) -> None:
        """The core's forward pre-hook; with ``gradient_accumulation_steps`` > 1, a training forward of the
        prepared model that is not the first since the last optimizer step starts a micro-batch that the
        previous one did not end with a step (every rank forwards the same number of times): the agreement
        is collected and launched here, an agreed notice carried out for the last step (``_rewound``). On the
        any-moment path such a forward is a hold point instead, as S+1's optimizer step (``_step_begin``): while
        a round writes S the micro-batches after it wait (an emergency throws them away; computing them only
        took CPU and the GIL from the background write), and an agreed exit leaves from here."""
        super()._on_forward(module, args)
        if module is not self._signal_model or self._internal or not module.training \
                or not torch.is_grad_enabled() or self._loop.explicit:
            return
        self._tops.forward(self._steps.count)  # the first one decides the scheduler's order (accelerate_sched.py)
        if self._mb_seq != self._book.post_seq:
            self._mb_seq = self._book.post_seq  # the first forward after a step: the step itself was the boundary
            self._sched_at = (self._steps.count, self._sched_counts())
            self._acc_fwd_rng = (self._steps.count, torch.get_rng_state())  # the boundary path's rng_at_forward
            self._iter_at = (self._steps.count, _iteration(self.accelerator))
            return
        if self.accelerator.gradient_accumulation_steps < 2 or self._steps.count == 0:
            return
        if self._bg_on:
            self._step_begin(enter=_nothing)
            return
        if getattr(self.accelerator, "even_batches", True) is False:
            return  # ranks' epochs may differ in micro-batches: an agreement here would pair with no peer's (a hang)
        self._last_boundary = self._steps.count  # FrameworkHook's "training started" mark
        self._framework_microbatch()

    def _sched_counts(self) -> list[tuple[Any, int]]:
        out = []
        for sched in getattr(self.accelerator, "_schedulers", []):
            inner = getattr(sched, "scheduler", sched)
            if isinstance(getattr(inner, "_step_count", None), int):
                out.append((inner, inner._step_count))
        return out

    def _act_in_microbatch(self, level: int, deadline_ms: int) -> None:
        """As at a boundary, inside ``_rewound``; with no snapshot of the last step (none taken yet) nothing
        is done: the notice stays pending and the next optimizer step's pre-hook acts on it."""
        if self._state_at.snap is not None:
            super()._act_in_microbatch(level, deadline_ms)

    @contextlib.contextmanager
    def _rewound(self) -> Iterator[None]:
        self._rewinding = True  # a save of S from a micro-batch: rng_at_forward is S's too (the forward after it)
        try:
            with self._as_of(self._state_at.snap):
                yield
        finally:
            self._rewinding = False

    # ------------------------------------------------------------- state <-> Accelerate

    @contextlib.contextmanager
    def _as_of(self, snap: Optional[Snapshot]) -> Iterator[None]:
        """RNG, running-stat buffers and Accelerate's micro-batch counter as they were right after the deciding
        step, for the duration of a save."""
        if snap is None:
            yield
            return
        acc, now_step, now_sched = self.accelerator, self.accelerator.step, self._sched_counts()
        with rng_and_buffers_at(snap.rng, self._buffers, self._end_buffers(self._steps.count)):
            if self._acc_step is not None and self._acc_step[0] == self._steps.count:
                acc.step = self._acc_step[1]
            if self._sched_at is not None and self._sched_at[0] == self._steps.count:
                for inner, n in self._sched_at[1]:
                    inner._step_count = n
            try:
                with self._tops.rewound(self._steps.count):
                    yield
            finally:
                for inner, n in now_sched:
                    inner._step_count = n
                acc.step = now_step

    @contextlib.contextmanager
    def _explicit_dirs(self) -> Iterator[None]:
        """``save_state``/``load_state`` ignore their folder under automatic_checkpoint_naming: switch it off meanwhile;
        and ``save_state`` counts ``project_configuration.iteration`` up whatever its folder: put it back, so that the
        user's own automatically named checkpoints keep the uninterrupted run's numbers (an ordinary notice)."""
        cfg = getattr(self.accelerator, "project_configuration", None)
        auto = bool(getattr(cfg, "automatic_checkpoint_naming", False))
        iteration = getattr(cfg, "iteration", None)
        if auto:
            cfg.automatic_checkpoint_naming = False
        try:
            yield
        finally:
            if auto:
                cfg.automatic_checkpoint_naming = True
            if isinstance(iteration, int):
                cfg.iteration = iteration

    def _write(self, key: str, snap: Optional[Snapshot]) -> None:
        def fill(target: str) -> None:
            iteration = self._iteration_of(self._steps.count)
            with self._as_of(snap), self._explicit_dirs():
                self.accelerator.save_state(target)
                save_rank_buffers(self.accelerator, Path(target), self.accelerator._models[0].state_dict())
            save_iteration(self.accelerator, Path(target), iteration)
            self._gens.write(Path(target), self.accelerator.process_index, self._gens.of(self._steps.count))
            fwd = self._acc_fwd_rng
            if (snap is not None or self._rewinding) and fwd is not None and fwd[0] == self._steps.count:
                torch.save(fwd[1], os.path.join(target, f"{RNG_AT_FORWARD}_{self.accelerator.process_index}.pt"))

        self._write_into(key, fill)

    def _write_into(self, key: str, fill: Any) -> None:
        """``fill(folder)`` writes Accelerate's files into the store's folder (local) or a staging folder that
        is uploaded; this rank's files (rank 0 the shared ones) are reported for the commit record."""
        local = self._storage.local_path(key)
        stage = None
        if local is not None:
            target = str(local)
        else:
            stage = staging_dir(f"accelerate-{self._rank}")
            target = str(stage)
        try:
            fill(target)
            rank = self._rank

            def mine(rel: str) -> bool:
                m = _RANK_FILE.match(rel)
                return int(m.group(1) or m.group(2)) == rank if m else rank == 0

            if stage is not None:
                upload_dir(self._storage, stage, key, select=mine)
            else:  # written in place: report this rank's files for the commit record
                report_local(self._storage, key, select=mine)
        finally:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)

    def _load(self, dirkey: str, digests: Any = None) -> Optional[DamagedCheckpoint]:
        """Every rank: verify (or download verified), agree, then let Accelerate load; damage is returned."""
        damage: Optional[DamagedCheckpoint] = None
        try:
            folder = verified_folder(self._storage, dirkey, self._log)
        except DamagedCheckpoint as exc:
            damage = exc
        if not self._all_ok(damage is None):
            return damage or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank found it damaged")
        with self._explicit_dirs():
            self.accelerator.load_state(os.fspath(folder))
        self._realign_at_load(os.fspath(folder))
        return None


def install(accelerator: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> FrameworkHook:
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    if engine is not None:
        # DeepSpeedPlugin: the engine owns the optimizer step (no torch optimizer hook would ever fire) and its
        # checkpoint: the DeepSpeed adapter, at the engine's step that accelerator.backward() calls at each sync
        from .deepspeed import DeepSpeedHook  # noqa: PLC0415 - imports deepspeed

        hook = DeepSpeedHook(engine, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                             every=every)
        # a torch scheduler DeepSpeed does not own stays Accelerate's, stepped by the loop after backward()
        outside = [s for s in getattr(accelerator, "_schedulers", [])
                   if getattr(s, "scheduler", s) is not getattr(engine, "lr_scheduler", None)
                   and type(s).__name__ != "DeepSpeedSchedulerWrapper"]
        if outside:
            hook.follow_schedulers(outside)
        return hook
    return AccelerateHook(accelerator, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                          every=every)
