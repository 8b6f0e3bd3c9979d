"""The hand-over of "the state at S" between the training thread and the agreement thread.

Why an object of its own (issue 28, part 2, as ``clock.py`` did for the step count): the training thread
records what it saw at each iteration's moments (the post-hook's snapshot, the first forward's buffers and RNG,
an explicit loop's boundary copy) and answers the agreement thread's requests (the small state, the fallback
read of the tensors); before, that was fifteen names in Hook's one namespace written from six files. Here
they live in one object, ``Hook._state_at``, guarded by the clock's ``cv`` (``StepClock.cv``: a round's hold
and this hand-over change together). It is a record, not an interface: the fields are assigned directly by the
files below, the taking and clearing are methods, and so are some of the checks (others compare fields).
Outside ``cv``: the first forward's records (``stephooks._on_forward`` writes them before it takes ``cv``,
``fwd_count`` last) and ``snap`` on the boundary path and at resume (no round beside them).

Who does what (the map, read from the code):

- the training thread records: ``snap``/``snap_count`` (the post-hook's RNG/loader snapshot: ``stephooks.py``
  ``_step_end``, ``boundary.py``, the Accelerate adapter), ``fwd_bufs``/``fwd_seq``, ``fwd_rng`` and
  ``fwd_count`` (the first forward after a step: ``stephooks.py``), ``range_small`` (an explicit loop's
  boundary copy: ``boundary.py``);
- the agreement thread asks (``stateat.py``, ``staged.py``): ``want_small`` (the small state of a step),
  ``want_state``/``want_copy`` (the training thread's read of the tensors: ``arm_read``), ``staged_step``
  (the staged save holds that step);
- the training thread answers in ``small`` and ``handoff`` (``stateat.py``: ``_capture_small_for``,
  ``_read_for_round``; ``stephooks.py``' held pre-hook; ``exit.py``'s teardown);
- ``release`` clears both sides when the round lets go of the hold (``stateat.py``: ``_release_hold``).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from .state import Snapshot

__all__ = ["StateAtS"]


class StateAtS:
    """What the two threads hand each other about the state at S (under ``cv``, the clock's; the exceptions are
    in the module docstring)."""

    def __init__(self, cv: threading.Condition) -> None:
        self.cv = cv
        # recorded by the training thread
        self.snap: Optional[Snapshot] = None  # RNG / loaders at the last post-hook
        self.snap_count = -1  # the count ``snap`` stands for
        # The model's first forward after step S (training or evaluation): the loop's work after the step
        # (scheduler, EMA update, scaler) is over, so the small state of S can be read (stateat.py).
        self.fwd_count = -1
        self.fwd_seq = 0  # Hook._book.post_seq at the last forward that snapshotted the buffers
        self.fwd_bufs: Optional[tuple[int, dict[str, dict[str, torch.Tensor]]]] = None
        self.fwd_rng: Optional[tuple[int, torch.Tensor]] = None  # (count, torch RNG) at the first training forward
        self.range_small: Any = None  # the small state read at the last proven boundary (``_copy_small``)
        # asked by the agreement thread
        self.want_small: Optional[int] = None  # a round waits for the small state of this step
        self.want_state: Optional[int] = None  # a round needs the training thread's read of this step (fallback)
        self.want_copy = True  # ... as a copy (an ordinary checkpoint; an emergency reads the held live tensors)
        self.staged_step: Optional[int] = None  # the staged save holds the training thread at this step
        # answered by the training thread
        self.small: Optional[tuple[int, Any, Any, str]] = None  # (step, per-rank blob, param_groups, where)
        self.handoff: Optional[tuple[Any, ...]] = None  # (step, state dict, bytes, error, where)

    # ------------------------------------------------------------ checks both sides make

    def snap_at(self, step: int) -> Optional[Snapshot]:
        """The post-hook snapshot of ``step``, if that is the one taken last."""
        return self.snap if self.snap is not None and self.snap_count == step else None

    def rng_at_forward(self, step: int) -> Optional[torch.Tensor]:
        """The torch RNG at the first training forward after ``step``, if one ran since (resume sets it back
        there: ``stephooks._realign_rng``)."""
        return self.fwd_rng[1] if self.fwd_rng is not None and self.fwd_rng[0] == step else None

    def has_small(self, step: int) -> bool:
        """The small state of ``step`` has been handed over."""
        return self.small is not None and self.small[0] == step

    def has_read(self, step: int) -> bool:
        """The training thread's read of ``step`` has been handed over."""
        return self.handoff is not None and self.handoff[0] == step

    def handed(self, step: int, got: Any = None) -> bool:
        """Whether the training thread's read answers a request for ``step``: that step, or the one before
        it read at the end of training (the iteration asked for will never come; the last one's work is over)."""
        got = self.handoff if got is None else got
        return got is not None and (got[0] == step or (got[0] == step - 1 and got[4] == "end-of-training"))

    # ------------------------------------------------------------ the agreement thread's side

    def arm_read(self, step: int, *, copy: bool) -> None:
        """(under ``cv``) Ask the training thread to read the state of ``step`` where it next can."""
        self.handoff = None
        self.want_state = step
        self.want_copy = copy
        self.cv.notify_all()

    def take_read(self) -> Any:
        """(under ``cv``) The training thread's read, taken: the request is over."""
        got, self.handoff, self.want_state = self.handoff, None, None
        return got

    def take_small(self, step: int) -> Any:
        """(under ``cv``) The small state of ``step`` if handed over (else None), taken."""
        got = self.small if self.has_small(step) else None
        self.small = None
        return got

    def clear_wants(self) -> None:
        """(under ``cv``) No request stands any more."""
        self.want_small = self.want_state = None

    def release(self) -> None:
        """(under ``cv``) The round let go of the hold: nothing handed over or asked for stands."""
        self.small = None
        self.clear_wants()
