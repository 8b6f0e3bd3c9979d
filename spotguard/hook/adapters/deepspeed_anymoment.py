"""The DeepSpeed engine's any-moment path: a notice is agreed and written while the training thread goes on.

Why: on the boundary path a notice waits for the next ``engine.step()`` (the step
in flight: seconds on a fine-tuning job) before anything is agreed or written. Here,
as in the plain hook (``agreement.py``), every rank's agreement thread (its own gloo
group, woken through the c10d store) decides the step S = the last completed
``engine.step()`` (MAX of the ranks' stands: a rank inside ``engine.step()`` stands
at the step it is finishing) and writes S from the background:

- **What cannot move**: ZeRO's fp32 master partitions, the base optimizer's moments,
  the bit16 weights (ZeRO-2), the loss scaler, DeepSpeed's scheduler and the
  engine's counters change only inside ``engine.step()``. The step after S is held at
  its start (the wrapper around ``engine.step``) until they are written — an emergency
  until the exit; an ordinary checkpoint only until they are copied to the host (else a
  write longer than the notice's window ran the hold out: exit 75 on a rebalance). Forward and backward of the next iteration go on meanwhile: they
  touch gradients and ZeRO's reduction buckets, which a checkpoint does not hold.
- **What moves between steps** (RNG, the ``add_state`` loaders: data position,
  samplers; the module's persistent buffers) is copied at the end of every
  ``engine.step()`` (``_ds_step_end``: microseconds for a data position and the RNG),
  so the round writes it as it was at S's end.
- **What the loop changes after the step** (the other ``add_state`` objects: an EMA
  updated right after ``engine.step()``, a meter) is read as at the *anchor* of
  iteration S+1, the engine's first training forward after S (as the plain hook's
  ``_copy_at_anchor``): the small ones (``ANCHOR_COPY_BYTES``) are copied there every
  iteration, a large one (an EMA: a model copy) is read by the round once the anchor
  has passed (it does not change again before the held ``engine.step()`` after S). A
  round that starts before the anchor waits for it, or for the end of training
  (``destroy_process_group()``: the loop's work is over), bounded as the plain hook's
  ``_small_state``; past that nothing is committed (the state of S's end is not known).
- **How it is written**: DeepSpeed's own layout and dicts
  (``engine._common_checkpoint_state``, the ZeRO optimizer's ``state_dict()``, the
  file names of ``_get_ckpt_name``/``_get_zero_ckpt_name``) through
  ``SpotguardCheckpointEngine`` (streamed to storage), without
  ``engine.save_checkpoint``: that one runs ``dist.barrier()`` and an all-reduce of
  the tag on the training group, which the background thread must never touch (the
  training thread may be inside a ZeRO collective of the next backward). The module's
  state dict is DeepSpeed's as at its own save: ZeRO-3's partitioned parameters as the
  empty placeholders its ``checkpoint_event_prologue`` leaves (a forward in flight may
  have gathered them: never read), buffers from the step's-end copy. The resume is
  unchanged: ``engine.load_checkpoint``.

Configurations this is not proven exact for keep the boundary path, said once in the
``notice_path`` line (``any_moment_refusal``): ZeRO stages other than 2 and 3,
optimizer or parameter offload, gradient accumulation (the partitions are exact
between micro-batches, but the engine's micro-step state is not written), MoE /
AutoEP folding, curriculum learning and random-LTD (their state moves in the data
path), schedulers stepped by the loop after ``engine.step()`` (``follow_schedulers``,
a torch scheduler given to ``add_state``), ``hook.range()``, and
``SPOTGUARD_BACKGROUND_AGREEMENT=0``.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Optional

import torch

from ...storage.base import join_key
from ..dist import NO_DEADLINE_MS
from ..save import _Result
from ..settings import HANDED_OVER, HOLD_SLACK, LEVEL_NONE
from ..periodic import stage_state_dict
from ..save import ANCHOR_COPY_BYTES, _tensor_bytes
from ..state import capture_rng, copy_state, pack
from .deepspeed_files import SpotguardCheckpointEngine

__all__ = ["AnyMomentMixin", "any_moment_refusal"]

_TAG = "ds"  # as the boundary path's: DeepSpeed's tag folder, the file names relative to it
_ROOT = "/spotguard-deepspeed"  # the save_dir DeepSpeed's name functions are given (nothing is created there)


def any_moment_refusal(engine: Any) -> Optional[str]:
    """None when the engine's checkpoint can be written from the background exactly; else why not."""
    if os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT", "1").strip() == "0":
        return "SPOTGUARD_BACKGROUND_AGREEMENT=0"
    stage = int(engine.zero_optimization_stage())
    if stage not in (2, 3):
        return f"ZeRO stage {stage}: the any-moment path is proven for stages 2 and 3 only"
    if _call(engine, "zero_use_cpu_optimizer") or _offloaded(_call(engine, "zero_offload_param")):
        return "optimizer or parameter offload: its copies to and from the host are not proven quiet between steps"
    if int(engine.gradient_accumulation_steps()) != 1:
        return ("gradient accumulation: the partitions are exact between micro-batches, but the engine's "
                "micro-step state is not in DeepSpeed's checkpoint")
    if getattr(engine, "has_moe_layers", False) or getattr(engine, "_autoep_folding_spec", None) is not None:
        return "MoE layers: DeepSpeed's MoE checkpoint is written by another path"
    if _call(engine, "curriculum_learning_enabled") or _call(engine, "random_ltd_enabled"):
        return "curriculum learning / random-LTD: their state moves in the data path, between steps"
    return None


def _call(engine: Any, name: str) -> Any:
    fn = getattr(engine, name, None)
    return fn() if callable(fn) else None


def _offloaded(cfg: Any) -> bool:
    device = getattr(cfg, "device", None)
    return cfg is not None and str(getattr(device, "value", device)) not in ("none", "None")


class AnyMomentMixin:
    """Part of ``DeepSpeedHook`` (``deepspeed.py``); see the module docstring."""

    engine: Any
    _ds_any: bool
    _ds_small: Optional[tuple[int, dict[str, Any], dict[str, Any], dict[str, torch.Tensor], Optional[str]]]
    _extra: dict[str, Any]
    _outside: list[Any]
    _ds_fwd: int = -1  # the step whose anchor (the first training forward after it) has passed
    _ds_anchor_copy: Optional[tuple[int, Optional[dict[str, Any]]]] = None  # (step, small objects copied there)
    _ds_small_keys: Optional[list[str]] = None  # the anchored objects copied at every anchor (decided at the first)
    _ds_ended = False  # destroy_process_group() came: the loop's work is over

    # ------------------------------------------------------------------ which add_state object is read where

    def _ds_loaders(self) -> list[str]:
        """``add_state`` keys read at the step's end: iterables (a loader, a sampler: the next batch is taken
        before the next forward), as the plain hook's loaders (``state.classify``)."""
        return [k for k, o in self._extra.items() if hasattr(o, "__iter__") or hasattr(o, "__next__")]

    def _anchored(self) -> list[str]:
        """``add_state`` keys read at the anchor of the next iteration (an EMA, a meter): neither a loader nor a
        scheduler the hook follows (read after its own step)."""
        loaders = set(self._ds_loaders())
        return [k for k, o in self._extra.items() if k not in loaders and not any(o is s for s in self._outside)]

    def _ds_at_anchor(self) -> None:
        """Engine forward pre-hook (training thread): the first training forward (grad enabled) after step S is
        the end of iteration S's post-step work; copy the small anchored objects as they are here."""
        if not torch.is_grad_enabled() or self._ds_fwd == self._steps.count:
            return
        copies: Optional[dict[str, Any]] = None
        try:
            keys = self._ds_small_keys
            if keys is None:
                keys = self._ds_small_keys = [k for k in self._anchored()
                                              if _tensor_bytes(self._extra[k].state_dict()) <= ANCHOR_COPY_BYTES]
            copies = {k: copy_state(self._extra[k].state_dict()) for k in keys}
        except Exception:  # noqa: BLE001 - the user's object: a round reads it live and reports what raised
            copies = None
        with self._steps.cv:
            self._ds_fwd = self._steps.count
            self._ds_anchor_copy = (self._steps.count, copies)
            self._steps.cv.notify_all()

    def _ds_anchor_states(self, step: int, t_end: float) -> Any:
        """(training thread held after S) The anchored objects' state dicts as at the anchor of the iteration
        after ``step`` (or the end of training), read from the round; a str: why not (bounded by ``t_end``)."""
        keys = self._anchored()
        if not keys:
            return {}
        now = time.monotonic()  # as the plain hook's _small_state: wait while the save still fits, always a little
        latest = max(now + min(1.0, max(0.0, t_end - now) / 3),
                     t_end - max(0.5, getattr(self, "_last_save_seconds", 1.0) * 1.5))
        with self._steps.cv:
            while self._ds_fwd != step and not self._ds_ended and not self._life.exit_requested and \
                    time.monotonic() < latest:
                self._steps.cv.wait(min(0.1, max(0.0, latest - time.monotonic())))
            if self._ds_fwd != step and not self._ds_ended:
                return (f"the loop's work after step {step} was not seen to end (no training forward of the engine "
                        "and no end of training since) before the save had to start to make the deadline: the "
                        "add_state objects of the end of that iteration are not known, nothing is committed")
            got = self._ds_anchor_copy if self._ds_fwd == step else None
        copies = dict(got[1] or {}) if got is not None and got[0] == step else {}
        try:
            live = {k: self._extra[k].state_dict() for k in keys if k not in copies}
            return {**copies, **copy.deepcopy(live)} if live else copies
        except Exception as exc:  # noqa: BLE001 - the user's object: the round fails with it
            return f"state_dict() at the anchor after step {step} raised {type(exc).__name__}: {exc}"

    def _serve_last_round(self, timeout: float) -> None:  # exit.py: destroy_process_group() after the last step
        with self._steps.cv:
            self._ds_ended = True  # a round waiting for the next anchor takes the state now: the loop is over
            self._steps.cv.notify_all()
        super()._serve_last_round(timeout)  # type: ignore[misc]

    # ------------------------------------------------------------------ the path

    def _why_not_background(self) -> Optional[str]:  # core.Hook: creates the agreement thread when None
        why = any_moment_refusal(self.engine)
        self._ds_any = why is None
        return why and f"{why} (the boundary path: a notice is acted on at the next engine.step())"

    def _ds_announce(self) -> None:
        if self._ds_any and self._bg is not None and self._bg.ok:
            self._log_path("any-moment", "deepspeed", "the engine's partitions change only inside engine.step(): "
                                                      "the step after S is held until they are written")
            self._book.keep(self.engine.register_forward_pre_hook(lambda *_: self._ds_forward_hold()))
        elif self._ds_any:
            self._ds_leave("the background agreement is not available")

    def _ds_leave(self, why: str) -> None:
        """From now on this engine acts on notices at its step boundary (said once, with why)."""
        if not self._ds_any:
            return
        self._ds_any = False
        self._bg_on = False
        bg = self._bg
        if bg is not None and bg.busy.is_set():  # a round in flight finishes (bounded) before the boundary path
            end = time.monotonic() + HOLD_SLACK
            while bg.busy.is_set() and time.monotonic() < end:
                time.sleep(0.01)  # rounds end without a notify: look again shortly
        self._log_path("boundary", "deepspeed", why)

    def _enable_background(self, clocked: bool = False) -> None:  # core: resume() and the first step call it
        self._bg_ready.set()
        if not self._ds_any or self._bg is None or not self._bg.ok or self._bg_on or self._life.torn_down:
            return
        self._turn_on_background()

    def _begin_explicit(self, loop: str, start: int) -> None:  # hook.range(): the loop's boundary decides
        self._ds_leave(f"{loop}: the loop's own boundary counts iterations")
        self._enter_explicit()

    # ------------------------------------------------------------------ the training thread

    def _ds_step(self, orig: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``engine.step()`` on the any-moment path: held while a round needs this step's start, then the step,
        then the copy of what moves between steps."""
        if not self._bg_on:
            self._enable_background()
        self._step_begin()  # core: held while a round runs or after it agreed S with this rank at S (bounded)
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            with self._steps.cv:
                self._steps.leave_step()
                self._steps.cv.notify_all()
            raise
        self._ds_step_end()
        return out

    def _ds_forward_hold(self) -> None:
        """The engine's forward, while an emergency's save runs: wait there (bounded), then leave with its outcome.

        Why: the iterations after S are thrown away anyway, and a forward/backward started now would take the
        CPU, memory bandwidth and GIL the save needs in the VM's last seconds; the start of a forward is outside
        every ZeRO collective, so holding there blocks no peer that is not about to be held too. The anchor's
        copy comes first: this forward is the anchor a round of S waits for."""
        self._ds_at_anchor()
        if self._round_action != "emergency" or not self._ds_any or \
                (not torch.is_grad_enabled() and self._ds_fwd != self._steps.count and self._anchored()):  # an evaluation
            # the round may wait for that anchor: holding here would keep it from coming
            self._exit_if_requested()
            return
        with self._steps.cv:
            # an emergency keeps its target until the exit (a failed save exits too): wait for that exit
            while self._steps.target is not None and not self._life.exit_requested and \
                    time.monotonic() < self._steps.hold_until + HOLD_SLACK:
                self._steps.cv.wait(0.5)
        self._exit_if_requested()

    def _capture_small_for(self, step: int, where: str) -> None:
        """core's pre-hook asks for the small state of the held step: here it is copied at every step's end."""

    def _ds_step_end(self) -> None:
        """After ``engine.step()``: when it advanced ``global_steps``, count it and copy the small state of its end."""
        engine = self.engine
        step = int(engine.global_steps)
        small = self._ds_capture(step) if step != self._steps.count else None
        with self._steps.cv:
            if small is not None:
                self._steps.set_count(step)
                self._last_boundary = step
                self._ds_small = small
            if self._every is None:
                self._steps.leave_step()
            self._steps.cv.notify_all()
        if small is not None:
            self._tick()
            if not self._loop.fresh_checked:
                self._warn_unresumed()  # the first step without hook.resume() over a committed checkpoint: say so
        if self._every is not None:  # every=: the boundary reduction carries the periodic votes only
            try:
                self._ds_periodic()
            finally:
                with self._steps.cv:
                    self._steps.leave_step()
                    self._steps.cv.notify_all()
        self._exit_if_requested()

    def _ds_periodic(self) -> None:
        """A periodic checkpoint at this boundary when a rank is due, written by the training thread (still "in the
        step": a round that starts meanwhile stands at the next step, never at this one's folder)."""
        if self._life.over():
            return
        if self._agree.pending:
            self._agree.collect()
        self._agree.launch(LEVEL_NONE, NO_DEADLINE_MS, self._periodic_flags())
        if self._agree.collect() is not None:
            self._maybe_periodic(None)

    def _ds_capture(self, step: int) -> tuple[int, dict[str, Any], dict[str, Any], dict[str, torch.Tensor],
                                              Optional[str]]:
        """(step, RNG, add_state loaders' state dicts, persistent buffers, error): copies, as at the step's end
        (the other add_state objects are read at the next anchor: ``_ds_anchor_states``)."""
        rng = capture_rng()
        try:
            states = {k: copy_state(self._extra[k].state_dict()) for k in self._ds_loaders()}
            bufs = {name: self.engine.module.get_buffer(name).detach().clone() for name in self._ds_buffers}
        except Exception as exc:  # noqa: BLE001 - the user's object: a round for this step fails with it
            return step, rng, {}, {}, f"state_dict() at step {step} raised {type(exc).__name__}: {exc}"
        return step, rng, states, bufs, None

    # ------------------------------------------------------------------ the agreement thread

    # The round itself is the plain hook's (agreement.py, ``_background_round``: join, gather, S, then this save,
    # then the exit or the release); only how S is written differs.

    def _save_staged(self, notice: Any, reason: str, step: int, t_end: float, group: Any, *,
                     hold: bool = False) -> _Result:
        """Wait (bounded) until this rank has ended step S and is held before the next, then write S (an emergency's
        step stays held through the write until the exit; an ordinary one's until S is copied to the host). After ``_ds_leave`` the notice goes to the boundary path (every rank alike)."""
        if not self._ds_any:
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        t0 = time.monotonic()
        small = self._ds_small if self._wait_step_end(step, t_end) else None
        if small is None or small[0] != step:
            return self._fail(notice, step, f"this rank did not reach the end of step {step} in time", t0,
                              peers_ok=True)
        anchored = self._ds_anchor_states(step, t_end)
        if isinstance(anchored, str):  # as the plain hook's small state: nothing of S is written
            self._release_hold(keep_target=hold)
            return self._fail(notice, step, anchored, t0, peers_ok=True)
        small = (small[0], small[1], {**small[2], **anchored}, small[3], small[4])
        if hold:  # an emergency: written from the live state, the step held until the exit
            return self._save(notice, reason, None, group=group, step=step,
                              write=lambda key: self._ds_put(key, self._ds_files(small)),
                              bound=max(1.0, t_end - time.monotonic()))
        # An ordinary checkpoint copies S to the host and lets training go on (as the plain hook's does): held
        # through the whole write, a write longer than the notice's window made the hold give up and exit 75.
        return self._save_built(notice, reason, step, group, t_end,
                                build=lambda: stage_state_dict(self._ds_files(small))[0], put=self._ds_put,
                                release=True)

    def _ds_files(self, small: tuple[int, dict[str, Any], dict[str, Any], dict[str, torch.Tensor],
                                     Optional[str]]) -> dict[str, Any]:
        """This rank's files of step S in DeepSpeed's layout (as ``save_checkpoint`` names and fills them, no
        collective) and its spotguard file (RNG and loaders at S's end, the other ``add_state`` objects at the
        next anchor): {relative name: object}."""
        from deepspeed.git_version_info import version  # noqa: PLC0415 - deepspeed is this adapter's import

        step, rng, states, bufs, err = small
        if err is not None:
            raise RuntimeError(err)
        engine = self.engine
        out: dict[str, Any] = {}
        if engine.save_non_zero_checkpoint:
            module = self._ds_module_state(bufs)
            out[engine._get_ckpt_name(_ROOT, _TAG)] = engine._common_checkpoint_state(
                module, engine.zero_optimization(), engine.zero_optimization_partition_gradients())
        if engine.save_zero_checkpoint:
            out[engine._get_zero_ckpt_name(_ROOT, _TAG)] = dict(
                optimizer_state_dict=engine.optimizer.state_dict(), ds_config=engine.config, ds_version=version)
        out[""] = {"rng": rng, "state": states, "step": step, "world_size": self._world}
        return out

    def _ds_put(self, key: str, files: dict[str, Any]) -> None:
        """Stream ``_ds_files``' objects into ``key`` through ``SpotguardCheckpointEngine``."""
        ce = SpotguardCheckpointEngine(self._storage, key, os.path.join(_ROOT, _TAG))
        for path, obj in files.items():
            if path:
                ce.save(obj, path)
        self._storage.write_bytes(join_key(key, f"spotguard_rank{self._rank}.pt"), pack(files[""]))

    def _ds_module_state(self, bufs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The module's state dict as DeepSpeed's save writes it: ZeRO-3's parameters as the empty placeholders of
        partitioned ones (never the gathered tensors a forward in flight may hold), buffers as at S's end."""
        engine = self.engine
        sd = engine.module_state_dict()
        if int(engine.zero_optimization_stage()) == 3:
            for name, p in engine.module.named_parameters():
                if hasattr(p, "ds_id") and name in sd:
                    sd[name] = torch.empty(0, dtype=p.dtype, device=p.device)
        for name, t in bufs.items():
            if name in sd:
                sd[name] = t
        return sd
