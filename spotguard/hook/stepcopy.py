"""Copies of the state of the last iteration boundary that an optimizer's first step in an iteration overwrites.

Why (issue 23): in a ``hook.range()``/``hook.step()`` loop with several optimizers (a GAN: D steps, then G), the
state a checkpoint stands for is the last boundary S. Once D has stepped, D's parameters and moments of S are
gone, so a notice after D's step had to wait for the iteration's end (seconds). Copying what D's step will
change just before it (its parameters and its optimizer state tensors: Adam's ``exp_avg``, ``step`` ...) keeps
S readable: a round that joins later writes D from these copies and every optimizer that has not stepped yet
from its live tensors, whose next step is held while the round reads. ``param_groups`` (``lr``...) come from
the boundary's own copy of the small state (a scheduler stepped at the iteration's top must not leak in).

The copies are buffers allocated once and reused (``Tensor.copy_``, on the tensors' own device), bounded by
``SPOTGUARD_STEP_COPY_MAX_BYTES`` (default 1 GiB per process; 0 switches the copies off). Later steps of the
same optimizer in the iteration (WGAN's n_critic) need no new copy; the iteration's last optimizer step takes
none (a notice after it waits for the boundary right after it: the post-step work only).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from .settings import env_bytes

__all__ = ["StepCopies", "STEP_COPY_MAX_BYTES"]

#: the most bytes the copies of one iteration may hold (all optimizers together); over it: no copies
STEP_COPY_MAX_BYTES = env_bytes("SPOTGUARD_STEP_COPY_MAX_BYTES", 1 << 30)

_ABSENT = object()  # an optimizer state entry that did not exist at the boundary (created by the first step)


class StepCopies:
    """The copies of boundary ``step`` (see the module docstring): ``before_first_step`` at an optimizer's
    first step of the iteration, ``substitute`` into a state dict read for ``step``, ``reset`` at the boundary."""

    def __init__(self, max_bytes: int = STEP_COPY_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.step: Optional[int] = None  # the boundary the copies stand for
        # (storage address, shape, dtype) of a live parameter -> its copy: every name for it in every model state
        # dict is replaced (tied weights have several; a module shared by G and D is in both models' dicts),
        # whatever name the optimizer's FQN gives
        self._params: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._state: dict[str, dict[str, Any]] = {}  # optimizer key -> FQN -> copy of its state (or _ABSENT)
        self._bufs: dict[tuple[str, int, str], torch.Tensor] = {}  # reused buffers
        self._fqns: dict[str, tuple[list[int], list[str]]] = {}  # optimizer key -> (parameter ids, their FQNs)
        self.nbytes = 0

    def reset(self, step: int) -> None:
        """A boundary: nothing has stepped since ``step`` (the buffers stay allocated for the next iteration)."""
        self.step = step
        self._params.clear()
        self._state.clear()
        self.nbytes = 0

    def has(self, key: str) -> bool:
        """Whether optimizer ``key`` has stepped since the boundary with its state of the boundary copied."""
        return key in self._state

    def active(self, step: int) -> bool:
        """Whether a state dict read for ``step`` must take some tensors from the copies."""
        return self.step == step and bool(self._state)

    def before_first_step(self, key: str, opt: torch.optim.Optimizer, model_key: str, model: torch.nn.Module
                          ) -> Optional[str]:
        """Copy what ``opt``'s step will change (training thread, before its first step since the boundary);
        None when done, else why not (the caller keeps the iteration's end for this iteration)."""
        if self.max_bytes <= 0:
            return "SPOTGUARD_STEP_COPY_MAX_BYTES=0"
        params = [p for g in opt.param_groups for p in g["params"]]
        fqns = self._fqns_of(key, params, model)
        if fqns is None:
            return f"optimizer {key} steps parameters that are not its model's ({model_key})"
        need = sum(_nbytes(p) + sum(_nbytes(v) for v in opt.state.get(p, {}).values()) for p in params)
        if self.nbytes + need > self.max_bytes:
            return (f"copying optimizer {key}'s parameters and state ({need / 2**20:.0f} MiB) before its step would "
                    f"exceed SPOTGUARD_STEP_COPY_MAX_BYTES ({self.max_bytes / 2**20:.0f} MiB)")
        pcopy = self._params
        scopy: dict[str, Any] = {}
        with torch.no_grad():
            for i, (p, fqn) in enumerate(zip(params, fqns)):
                pcopy[_ident(p)] = self._into((key, i, ""), p.detach())
                st = opt.state.get(p)
                scopy[fqn] = _ABSENT if st is None else {
                    n: self._into((key, i, n), v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for n, v in st.items()}
        self._state[key] = scopy
        self.nbytes += need
        return None

    def substitute(self, sd: dict[str, Any], step: int) -> dict[str, Any]:
        """``sd`` (``_tensor_state``: model and optimizer state dicts by key) with the copied tensors of ``step``
        in place of the live ones; shallow copies, the live dicts are never written."""
        if not self.active(step):
            return sd
        out = dict(sd)
        params = self._params
        for mk, msd in sd.items():  # every model's state dict (an optimizer's holds no tensor at its top level)
            if isinstance(msd, dict) and any(isinstance(v, torch.Tensor) and _ident(v) in params for v in msd.values()):
                out[mk] = {k: params.get(_ident(v), v) if isinstance(v, torch.Tensor) else v for k, v in msd.items()}
        for ok, states in self._state.items():
            osd = out.get(ok)
            if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict):
                continue
            st = dict(osd["state"])
            for fqn, v in states.items():
                if v is _ABSENT:
                    st.pop(fqn, None)
                else:
                    st[fqn] = v
            out[ok] = {**osd, "state": st}
        return out

    def _into(self, key: tuple[str, int, str], t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into the buffer kept for ``key`` (allocated again only if its shape/dtype/device changed)."""
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._bufs[key] = torch.empty_like(t, memory_format=torch.preserve_format)
        buf.copy_(t)
        return buf

    def _fqns_of(self, key: str, params: list[torch.Tensor], model: torch.nn.Module) -> Optional[list[str]]:
        """The model state dict's FQN of each parameter (as ``get_model_state_dict``/``get_optimizer_state_dict``
        name them: DDP's ``module.`` and compile's ``_orig_mod.`` stripped); cached while the parameters stay."""
        ids = [id(p) for p in params]
        got = self._fqns.get(key)
        if got is not None and got[0] == ids:
            return got[1]
        from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415

        by_id: dict[int, str] = {}
        for name, p in model.named_parameters():
            names = _get_fqns(model, name)
            if len(names) == 1:
                by_id[id(p)] = next(iter(names))
        if any(i not in by_id for i in ids):
            return None
        fqns = [by_id[i] for i in ids]
        self._fqns[key] = (ids, fqns)
        return fqns


def _ident(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    """Which parameter a state dict's tensor is (``state_dict()`` hands out detached views of the same storage)."""
    return (t.data_ptr() if t.numel() else -1, tuple(t.shape), t.dtype)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
