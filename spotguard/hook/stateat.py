"""The state at S: what the checkpoint of step S holds, read at the one moment it is known exactly.

Why a module of its own (issue 28, part 2): the training thread and the agreement thread hand each other the
state of a step here, under the clock's ``_steps.cv`` (``clock.py``), and nothing else in the save reads how:

- the tensors (model, optimizer): read off the training thread while ``StateWatch`` proves them unchanged since
  step S (``_background_read``), or by the training thread itself at its next anchor (``_prehook_read``,
  ``_read_for_round``, ``_serve_anchor_read``: the exact fallback);
- the small state (schedulers, scalers, stateful objects, param_groups, RNG, loaders, buffers): copied at the
  iteration's anchor — the first training forward after step S, the next step's pre-hook, an explicit loop's
  boundary (``_copy_at_anchor``, ``_copy_small``, ``_capture_small_for``), packed for a round
  (``_small_state``);
- the per-rank blob (``_per_rank_state``, ``_end_buffers``) from the snapshot the step hooks took.

What the two threads hand each other (the post-hook's snapshot, the first forward's buffers and RNG, the
requests and their answers) is one object, ``Hook._state_at`` (``handover.py``: ``StateAtS``, its map of who
writes which field); this module reads and answers through it, and ``_release_hold`` clears it with the
clock's hold.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch

from .periodic import stage_state_dict
from .state import Snapshot, clone_buffers, copy_state, pack

__all__ = ["StateAtMixin", "ANCHOR_COPY_BYTES", "StateMoved"]

#: a stateful object whose state_dict holds at most this many bytes of tensors is copied at every iteration's
#: anchor (``_copy_at_anchor``); a bigger one (an EMA) is read when a round needs it
ANCHOR_COPY_BYTES = 64 << 10

_BG = threading.local()  # ``on`` while the agreement thread reads state dicts


def _skip_fake_step_in_background() -> None:
    """Make DCP's ``_init_optim_state`` a no-op on the agreement thread (once per process).

    Why: for an optimizer without state (plain SGD) whose gradients are None,
    ``get_optimizer_state_dict`` runs a fake ``optimizer.step()`` with zero
    gradients and lr 0, then ``zero_grad()``: from a background thread that would
    write gradients and ``lr`` under the training thread. Skipped there, the state
    dict is what the fake step would have produced for such an optimizer (no
    state); an optimizer that has stepped has state and is never touched.
    """
    import torch.distributed.checkpoint.state_dict as sdmod  # noqa: PLC0415

    orig = sdmod._init_optim_state
    if getattr(orig, "__spotguard__", False):
        return

    def init(optim: Any) -> None:
        if getattr(_BG, "on", False):
            return
        try:
            orig(optim)
        except NotImplementedError:
            # A wrapper whose step() is not the update (SAM: first_step/second_step): there is no fake step
            # to run; its state dict is what it holds (an empty state loads into a fresh one as well).
            pass

    init.__spotguard__ = True  # type: ignore[attr-defined]
    sdmod._init_optim_state = init


class StateMoved(Exception):
    """A write from live tensors that the watch no longer vouches for (the attempt must not commit)."""


def _tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(_tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_tensor_bytes(v) for v in sd)
    return 0


def _with_small(sd: dict[str, Any], groups: dict[str, list[dict[str, Any]]], rank_key: str, blob: bytes
                ) -> dict[str, Any]:
    """The state dict with param_groups (lr...) as they stood after the loop's scheduler step, and the
    per-rank blob; shallow copies, so a live state dict's optimizer groups are never written."""
    out = dict(sd)
    for k, pg in groups.items():
        osd = out.get(k)
        staged = osd.get("param_groups") if isinstance(osd, dict) else None
        if isinstance(staged, list) and len(staged) >= len(pg):
            # more groups now: ``add_param_group`` since (it appends; the new ones did not exist at the step)
            out[k] = {**osd, "param_groups": [{**dst, **src} for dst, src in zip(staged, pg)] + staged[len(pg):]}
    out[rank_key] = blob
    return out


class StateAtMixin:
    """Part of ``Hook`` (through ``SaveMixin``); see the module docstring."""

    def _save_state_dict(self, snap: Optional[Snapshot]) -> dict[str, Any]:
        if snap is None:
            snap = Snapshot.take(self._objs.loaders)
        sd = self._tensor_state()
        sd[self._rank_key(self._rank)] = pack(self._per_rank_state(self._steps.count, snap))
        return sd

    def _per_rank_state(self, step: int, snap: Snapshot) -> dict[str, Any]:
        """This rank's own state at ``step`` (the per-rank blob's contents): RNG, loader and running-stat
        buffers from ``snap``; schedulers, scalers and stateful objects as they are now."""
        o = self._objs
        return {
            "step": step,
            "world_size": self._world,
            "rng": snap.rng,
            "loaders": snap.loaders,
            "buffers": self._end_buffers(step),
            "schedulers": {k: s.state_dict() for k, s in o.schedulers.items()},
            "scalers": {k: s.state_dict() for k, s in o.scalers.items()},
            "stateful": {k: s.state_dict() for k, s in o.stateful.items()},
            # the torch RNG at the first training forward after ``step`` (when it already ran): resume sets
            # it back there if something drew in between that the uninterrupted run did not (stephooks._realign_rng)
            "rng_at_forward": self._state_at.rng_at_forward(step),
        }

    def _end_buffers(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """The tracked buffers at the end of iteration ``step``: after the loop's post-step updates (an
        ``AveragedModel``'s ``n_averaged``), before the next forward's (BatchNorm statistics, spectral norm's
        ``_u``/``_v``) — the copy the first forward after the step took, or, when no forward ran since the last
        optimizer step, the buffers as they are now."""
        got = self._state_at.fwd_bufs
        if got is not None and got[0] == step and self._state_at.fwd_seq == self._book.post_seq:
            return got[1]
        return clone_buffers(self._buffers)

    def _handing_over(self, step: int) -> bool:
        """An explicit loop left the any-moment path before ``step`` was proven to end an iteration: the
        round hands its notice to the loop's boundary path instead of failing it."""
        return self._loop.range_broken is not None and self._loop.confirmed != step

    def _background_read(self, step: int, *, copy: bool) -> Any:
        """(state dict, bytes, "background") read off the training thread, or why it cannot be proven exact."""
        mark = self._watch.current()  # every check of this read is against the mark it started from
        why = self._watch.changed(mark)
        if why is not None:
            return why
        ev_ = self._book.step_event
        if ev_ is not None:
            ev_.synchronize()  # CUDA: step S's kernels (recorded on the training stream) are done
        _BG.on = True
        try:
            _skip_fake_step_in_background()
            sd = self._tensor_state() if self._watch.sharded is None else self._sharded_tensor_state()
            sd = self._step_copies.substitute(sd, step)  # an optimizer that stepped since S: its copies of S
            sd, nbytes = stage_state_dict(sd) if copy else (sd, _tensor_bytes(sd))
        except Exception as exc:  # noqa: BLE001 - try the training thread's read instead
            return f"background read failed: {type(exc).__name__}: {exc}"
        finally:
            _BG.on = False
        if copy:
            why = self._watch.changed(mark)  # moved during the copy: it may be torn
            if why is not None:
                return why
        else:
            self._live_mark = mark  # the write from these live tensors is checked against it (_dcp_writer)
        return sd, nbytes, "background"

    def _prehook_read(self, step: int, t_end: float, *, copy: bool, armed: bool = False) -> Any:
        """Ask the training thread for the state dict of ``step``: read at its first training forward after
        that step (``_serve_anchor_read``), else at its next ``optimizer.step()`` pre-hook (held there; a loop whose
        forwards the hook does not see) or the end of training; (state dict, bytes, where, the step read) or why
        not. Bounded by ``t_end``."""
        with self._steps.cv:
            if not armed:
                self._state_at.arm_read(step, copy=copy)
            while not self._state_at.handed(step) and not self._life.exit_requested and not self._handing_over(step):
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self._steps.cv.wait(min(0.5, left))
            got = self._state_at.take_read()
        if got is None or not self._state_at.handed(step, got):
            return (f"the training thread did not reach the end of iteration {step} (its next training forward "
                    "or optimizer.step()) within the notice deadline; that state could not be read exactly")
        if got[3]:
            return got[3]
        return got[1], got[2], got[4], got[0]

    def _read_for_round(self, step: int, where: str = "pre-hook") -> None:
        """Training thread, at the end of iteration ``step`` (under ``_steps.cv``): the fallback read."""
        self._internal = True  # DCP's fake step() on a stateless optimizer must not count
        try:
            # FSDP2: from its sharded parameters, never through its state-dict hooks — they reshard parameters
            # its pre-forward has just unsharded (a read at the anchor forward would break that forward)
            sd = self._tensor_state() if self._watch.sharded is None else self._sharded_tensor_state()
            sd = self._step_copies.substitute(sd, step)  # an optimizer that stepped since S: its copies of S
            sd, nbytes = stage_state_dict(sd) if self._state_at.want_copy else (sd, _tensor_bytes(sd))
            self._state_at.answer_read((step, sd, nbytes, "", where))
        except Exception as exc:  # noqa: BLE001 - reported by the round, never raised into the training loop
            self._state_at.answer_read((step, None, 0, f"reading the state at step {step}: {type(exc).__name__}: {exc}",
                                        where))
        finally:
            self._internal = False
        self._steps.cv.notify_all()

    def _serve_anchor_read(self, step: int, where: str) -> Optional[int]:
        """Training thread, under ``_steps.cv``, at the end of iteration ``step`` (its first training forward after
        the step, or an explicit loop's boundary): serve a read the round asked for (``_save_next_iteration``);
        an emergency's live tensors are written from where they are, so the thread stays here until the exit
        (bounded by the round's hold: past it, the step to give up at — ``_give_up_hold``, outside ``_steps.cv``)."""
        if self._state_at.want_state != step or self._state_at.has_read(step):
            return None
        self._read_for_round(step, where)
        if self._state_at.want_copy:
            return None
        while not self._life.exit_requested and self._steps.target == step:
            left = self._steps.hold_left()
            if left <= 0:  # the write from these live tensors may still run: never train on under it
                return step
            self._steps.cv.wait(min(0.5, left))
        return None

    def _small_state(self, step: int, t_end: float) -> Any:
        """(per-rank blob, param_groups, where) of ``step``, or why not.

        Read at the first moment the loop's work after ``optimizer.step()`` is known
        to be over: the model's next training forward (not an evaluation's: a
        ``ReduceLROnPlateau`` steps after it; the forward pre-hook copies it every
        iteration on the training thread, so a round that starts later still gets
        the state of that moment, not a meter updated since), the next step's
        pre-hook, or the end of training (``destroy_process_group()``). If none comes before the save must start to make the deadline
        (a data-loading stall right after the step longer than the notice), nothing
        is committed: the state of the end of the iteration is not known yet.
        """
        now = time.monotonic()  # wait for the anchor while the save still fits, and always a little
        latest = max(now + min(1.0, max(0.0, t_end - now) / 3),
                     t_end - max(0.5, getattr(self, "_last_save_seconds", 1.0) * 1.5))
        with self._steps.cv:
            rs = self._state_at.range_small
            if not self._state_at.has_small(step) and rs is not None and rs[0] == step:
                self._capture_small_for(step, "iteration-boundary")  # what the explicit loop's boundary copied
            if not self._state_at.has_small(step):
                if self._state_at.fwd_count == step and self._anchor_ok(step):
                    self._capture_small_for(step, "after-forward")
                else:
                    self._state_at.ask_small(step)
                    while not self._state_at.has_small(step) and \
                            not (self._state_at.fwd_count == step and self._anchor_ok(step)) and \
                            not self._handing_over(step) and not self._life.exit_requested and time.monotonic() < latest:
                        self._steps.cv.wait(min(0.1, max(0.0, latest - time.monotonic())))
                    self._state_at.cancel_small()
                    if not self._state_at.has_small(step) and self._state_at.fwd_count == step and \
                            self._anchor_ok(step):
                        self._capture_small_for(step, "after-forward")
            got = self._state_at.take_small(step)
        if got is None:
            return (f"the loop's work after step {step} was not seen to end (no forward of the model and no "
                    "optimizer step since) before the save had to start to make the deadline: the state of the "
                    "end of that iteration is not known, nothing is committed")
        if got[1] is None:
            return got[3]
        return got[1], got[2], got[3]

    def _capture_small_for(self, step: int, where: str) -> None:
        """``_capture_small`` into ``_state_at.small`` (under ``_steps.cv``); a raising ``state_dict()`` is
        recorded, not raised.
        An explicit loop's step: what its boundary read (the exact end of that iteration), whoever asks."""
        rs = self._state_at.range_small
        if rs is not None and rs[0] == step:
            if rs[1] is None:  # its state_dict() raised at the boundary
                self._state_at.answer_small(rs)
            else:
                try:
                    self._state_at.answer_small((step, pack(rs[1]), rs[2], rs[3]))
                except Exception as exc:  # noqa: BLE001 - recorded for the round, never raised into the loop
                    self._state_at.answer_small((step, None, None, f"packing the small state of step {step}: "
                                                 f"{type(exc).__name__}: {exc}"))
            self._steps.cv.notify_all()
            return
        try:
            self._state_at.answer_small(self._capture_small(step, where))
        except Exception as exc:  # noqa: BLE001 - the user's object: the round fails with this, training goes on
            self._state_at.answer_small((step, None, None, f"state_dict() of the small state raised at step {step}: "
                                         f"{type(exc).__name__}: {exc}"))
        self._steps.cv.notify_all()

    def _sharded_tensor_state(self) -> dict[str, Any]:
        """FSDP2, off the training thread: what ``get_model_state_dict`` / ``get_optimizer_state_dict`` give
        (FQN -> sharded DTensor; optimizer state and groups by FQN), built from FSDP2's sharded parameters and
        ``Optimizer.state_dict()`` without running any module's state-dict hook (FSDP2's reshards)."""
        from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415

        o, sharded = self._objs, self._watch.sharded
        assert sharded is not None
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            msd: dict[str, Any] = {fqn: p.detach() for fqn, p in sharded[k]}
            for name, b in self._watch._bufs.get(k, {}).items():
                fqns = _get_fqns(m, name)
                if len(fqns) != 1:
                    raise RuntimeError(f"buffer {name}: {len(fqns)} FQNs")
                msd[next(iter(fqns))] = b.detach()
            sd[k] = msd
        for k, opt in o.optimizers.items():
            fqn_of = {id(p): fqn for fqn, p in sharded[o.owner[k]]}
            params = [p for g in opt.param_groups for p in g["params"]]
            by_index = {i: fqn_of[id(p)] for i, p in enumerate(params)}  # KeyError: not an FSDP2 parameter
            osd = opt.state_dict()
            sd[k] = {"state": {by_index[i]: v for i, v in osd["state"].items()},
                     "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in osd["param_groups"]]}
        return sd

    def _tensor_state(self) -> dict[str, Any]:
        """Model and optimizer state dicts, by model / optimizer name (references: a background save stages
        them, after ``_skip_fake_step_in_background``)."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        o = self._objs
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            sd[k] = get_model_state_dict(m)
        for k, opt in o.optimizers.items():
            sd[k] = get_optimizer_state_dict(o.models[o.owner[k]], opt)
        return sd

    def _capture_small(self, step: int, where: str) -> tuple[int, bytes, dict[str, list[dict[str, Any]]], str]:
        """(step, per-rank blob, optimizer param_groups without params, who captured it) — call under ``_steps.cv``.

        The state the loop changes *after* ``optimizer.step()``: schedulers, scalers,
        stateful objects (EMA...), and the optimizer's param_groups (a scheduler writes
        ``lr`` there). RNG, loader and running-stat buffers come from the snapshot of
        step ``step``'s post-hook, as at a boundary.
        """
        o = self._objs
        snap = self._state_at.snap_at(step) or Snapshot.take(o.loaders)
        per = self._per_rank_state(step, snap)
        groups = self._groups_copy()
        anchor = getattr(self, "_anchor_copy", None)
        if anchor is not None and anchor[0] == step:  # what the iteration's anchor copied wins (a meter)
            per["stateful"].update(anchor[1])
            groups = anchor[2]
        return step, pack(per), groups, where

    def _groups_copy(self) -> dict[str, list[dict[str, Any]]]:
        """Every optimizer's ``param_groups`` as they are now, without ``params`` (a scheduler writes ``lr`` there)."""
        return {k: [{n: copy_state(v) for n, v in g.items() if n != "params"} for g in opt.param_groups]
                for k, opt in self._objs.optimizers.items()}

    def _copy_at_anchor(self, step: int) -> None:
        """Training thread, at each iteration's anchor (its first training forward): copy what the loop may
        still change before the next ``optimizer.step()`` — a running-loss meter, a samples-seen counter, the
        optimizer's ``param_groups`` — so that a round starting later in the iteration reads the state of the
        anchor, not a meter updated since. Only the small stateful objects (their state_dict holds at most
        ``ANCHOR_COPY_BYTES`` of tensors, decided at the first anchor): an EMA's shadow weights would cost a
        model copy per iteration, and it changes in the post-step work; schedulers change only in ``step()``
        and scalers only in ``update()``, so both are read when a round needs them."""
        o = self._objs
        try:
            small = getattr(self, "_anchor_small_keys", None)
            if small is None:
                small = self._anchor_small_keys = [k for k, obj in o.stateful.items()
                                                   if _tensor_bytes(obj.state_dict()) <= ANCHOR_COPY_BYTES]
            self._anchor_copy = (step, {k: copy_state(o.stateful[k].state_dict()) for k in small},
                                 self._groups_copy())
        except Exception:  # noqa: BLE001 - the user's object: a round reads it live and reports what raised
            self._anchor_copy = None

    def _copy_small(self, step: int, where: str) -> tuple[int, Any, Any, str]:
        """(step, per-rank state, param_groups, where) as ``_capture_small`` reads them, copied instead of
        packed (an explicit loop's boundary: every iteration); (step, None, None, why) if a state_dict() raised."""
        import copy  # noqa: PLC0415

        o = self._objs
        try:
            snap = self._state_at.snap_at(step) or Snapshot.take(o.loaders)
            per = self._per_rank_state(step, snap)
            for k in ("schedulers", "scalers", "stateful"):  # state_dict() may hand out live containers
                per[k] = copy.deepcopy(per[k])
            groups = self._groups_copy()
        except Exception as exc:  # noqa: BLE001 - the user's object: a round for this step fails with it
            return step, None, None, (f"state_dict() of the small state raised at step {step}: "
                                      f"{type(exc).__name__}: {exc}")
        return step, per, groups, where

    def _release_hold(self, keep_target: bool = False) -> None:
        """Let the training thread step again (``keep_target``: an emergency keeps it held until the exit)."""
        with self._steps.cv:
            self._steps.unhold(keep_target)
            self._state_at.release()
            self._steps.cv.notify_all()
