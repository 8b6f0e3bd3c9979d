"""The step hooks' own bookkeeping: what they installed, and what they count on the training thread.

Why an object of its own (issue 28, part 2, as ``clock.py`` did for the step count): the optimizer and forward
hooks (``stephooks.py``) keep counters and marks between calls — the post-hooks seen, the training forwards and
backwards, the CUDA event of a step's end, the RNG a resumed run realigns to — and the handles, method shadows
and ``GradScaler`` patch they must undo. That was fourteen names in Hook's one namespace, initialised in
``core.py`` and used from ``stephooks.py``, ``boundary.py``, ``stateat.py``, ``resume.py`` and five adapter
modules. Here they have one owner, ``Hook._book``; a field that two files move is moved by a named method, a
field one file writes is assigned there (a record: no property guards a field; ``tests/hook/test_owners.py``
checks that rule). No lock: every field is the training thread's, except ``step_event``,
which the agreement thread's background read (``stateat.py:_background_read``) only reads.

Who does what (the map, read from the code):

- set once here: ``scaler`` (the dict's ``GradScaler``: its ``update()`` is the clock), ``cuda_params``;
- ``stephooks.py`` alone: ``clock`` (the one optimizer whose steps count), ``post_seq`` (optimizer post-hooks
  and scaler updates so far; read by ``boundary.py``, ``stateat.py``, the Accelerate adapter),
  ``bwd_since_step``, ``train_fwd_seq``, ``last_fwd_training``, ``fwd_train_count``, ``skip_warned``;
- ``step_event`` (CUDA: recorded on the training stream where the state a background read copies is final):
  ``record_step_event`` (``stephooks.py:_step_end``, ``boundary.py``'s explicit boundary and step copies);
- ``realign`` (after a resume: the RNG the first training forward must see): ``realign_to`` (``resume.py``,
  the Accelerate any-moment adapter's load), ``take_realign`` (``stephooks.py:_realign_rng``);
- ``handles``/``unwrap``/``scaler_orig``: ``keep``, ``shadow``, ``patch_scaler`` (``stephooks.py``'s install,
  the DeepSpeed and Lightning-DeepSpeed adapters' own hooks and wrappers), ``remove`` (``_remove_step_hooks``:
  ``close()``, an explicit loop's boundary path).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

__all__ = ["StepBook"]


class StepBook:
    """The step hooks' counters, marks and installed hooks (see the module docstring)."""

    def __init__(self, scalers: Mapping[str, Any], models: Mapping[str, Any]) -> None:
        self.scaler: Any = next(iter(scalers.values()), None)
        self.cuda_params = any(p.is_cuda for m in models.values() for p in m.parameters())
        self.clock: Optional[torch.optim.Optimizer] = None  # one optimizer: its steps (several: cycle.py)
        self.post_seq = 0  # optimizer post-hooks so far (any optimizer of the dict; the scaler's update)
        self.step_event: Any = None  # CUDA: recorded on the training stream at each step's end
        self.bwd_since_step = False  # a backward reached the clock's parameters since the last step
        self.train_fwd_seq = 0  # training forwards (train mode, grad enabled) so far
        self.last_fwd_training = False
        self.fwd_train_count = -1  # the count at the last step's first train-mode forward
        self.skip_warned = False  # optimizer_step_skipped said
        self.realign: Optional[torch.Tensor] = None  # after a resume: the RNG the first training forward must see
        self.handles: list[Any] = []  # hook handles (anything with .remove())
        self.unwrap: list[tuple[Any, str]] = []  # instance attributes the hook set over methods
        self.scaler_orig: Optional[tuple[Any, Any]] = None

    def record_step_event(self) -> None:
        """CUDA parameters: record an event on the training stream; the background read waits on it (the
        kernels before this point are done). Nothing without CUDA parameters."""
        if self.cuda_params:
            self.step_event = torch.cuda.Event()
            self.step_event.record()

    def realign_to(self, rng: Optional[torch.Tensor]) -> None:
        """After a resume: the torch RNG the first training forward must see (None: none saved)."""
        self.realign = rng

    def take_realign(self) -> Optional[torch.Tensor]:
        """The RNG to realign to, once (the first training forward)."""
        saved, self.realign = self.realign, None
        return saved

    def keep(self, handle: Any) -> None:
        """A hook handle ``remove()`` undoes."""
        self.handles.append(handle)

    def shadow(self, obj: Any, name: str) -> None:
        """``obj.name`` is an instance attribute the hook set over a method: ``remove()`` deletes it."""
        self.unwrap.append((obj, name))

    def patch_scaler(self, step: Any, update: Any, orig: tuple[Any, Any]) -> None:
        """The scaler's ``step``/``update`` are the hook's wrappers from now on (``orig``: its own)."""
        self.scaler.step, self.scaler.update = step, update
        self.scaler_orig = orig

    def remove(self) -> None:
        """Undo what was installed: the handles, the method shadows, the scaler patch."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for obj, name in self.unwrap:
            try:
                delattr(obj, name)  # the instance attribute shadowing the method
            except AttributeError:
                pass
        self.unwrap = []
        if self.scaler is not None and self.scaler_orig is not None:
            for name in ("step", "update"):
                try:
                    delattr(self.scaler, name)  # the instance attribute shadowing the method
                except AttributeError:
                    pass
            self.scaler_orig = None
