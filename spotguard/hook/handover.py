"""The hand-over of "the state at S" between the training thread and the agreement thread.

Why an object of its own (issue 28, part 2, as ``clock.py`` did for the step count): the training thread
records what it saw at each iteration's moments (the post-hook's snapshot, the first forward's buffers and RNG,
an explicit loop's boundary copy) and answers the agreement thread's requests (the small state, the fallback
read of the tensors); before, that was fifteen names in Hook's one namespace written from six files. Here
they live in one object, ``Hook._state_at``, guarded by the clock's ``cv`` (``StepClock.cv``: a round's hold
and this hand-over change together). It is an interface, not a record: the fields are read-only properties,
and every change is a named move of this file, said "(under cv)" where the caller holds ``cv``
(``tests/hook/test_owners.py`` fails on a write from any other file). Outside ``cv``: the first forward's
records (``stephooks._on_forward`` makes them before it takes ``cv``, ``record_forward_count`` last) and the
snapshots on the boundary path and at the Accelerate adapter's resume (no round beside them).

Who does what (the map, read from the code):

- the training thread records: ``record_snap`` (``snap``/``snap_count``, the snapshot of a step's end:
  ``stephooks._step_end``, ``boundary._clocked_boundary``, the Accelerate adapter's resume),
  ``record_boundary_snap`` (``snap`` alone, the boundary path's: ``boundary._decide``,
  ``stephooks._cycle_end``), ``record_forward_bufs`` / ``record_forward_rng`` / ``record_forward_count``
  (the first forward after a step: ``stephooks._on_forward``; the buffers also at an explicit loop's
  boundary), ``record_range_small`` (an explicit loop's boundary copy: ``boundary.py``);
- the agreement thread asks (``stateat.py``, ``staged.py``): ``ask_small`` / ``cancel_small`` (the small
  state of a step: ``_small_state``), ``arm_read`` (the training thread's read of the tensors, as a copy or
  not), ``drop_small`` (the exact fallback asks for another step), ``hold_staged`` (the staged save holds
  that step);
- the training thread answers: ``answer_small`` and ``answer_read`` (``stateat.py``: ``_capture_small_for``,
  ``_read_for_round``, which ``stephooks.py``' held pre-hook and anchor forward, the explicit boundary and
  ``exit.py``'s teardown call);
- the agreement thread takes the answers (``take_small``, ``take_read``) and clears the requests
  (``clear_wants``; ``release`` when the round lets go of the hold: ``stateat._release_hold``).
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
        self._cv = cv
        # recorded by the training thread
        self._snap: Optional[Snapshot] = None  # RNG / loaders at the last post-hook
        self._snap_count = -1  # the count ``snap`` stands for
        # The model's first forward after step S (training or evaluation): the loop's work after the step
        # (scheduler, EMA update, scaler) is over, so the small state of S can be read (stateat.py).
        self._fwd_count = -1
        self._fwd_seq = 0  # Hook._book.post_seq at the last forward that snapshotted the buffers
        self._fwd_bufs: Optional[tuple[int, dict[str, dict[str, torch.Tensor]]]] = None
        self._fwd_rng: Optional[tuple[int, torch.Tensor]] = None  # (count, torch RNG) at the first training forward
        self._range_small: Any = None  # the small state read at the last proven boundary (``_copy_small``)
        # asked by the agreement thread
        self._want_small: Optional[int] = None  # a round waits for the small state of this step
        self._want_state: Optional[int] = None  # a round needs the training thread's read of this step (fallback)
        self._want_copy = True  # ... as a copy (an ordinary checkpoint; an emergency reads the held live tensors)
        self._staged_step: Optional[int] = None  # the staged save holds the training thread at this step
        # answered by the training thread
        self._small: Optional[tuple[int, Any, Any, str]] = None  # (step, per-rank blob, param_groups, where)
        self._handoff: Optional[tuple[Any, ...]] = None  # (step, state dict, bytes, error, where)

    # ------------------------------------------------------------ what anyone may read (read-only)

    @property
    def cv(self) -> threading.Condition:
        """The clock's Condition (``StepClock.cv``): it guards this hand-over too."""
        return self._cv

    @property
    def snap(self) -> Optional[Snapshot]:
        """RNG / loaders at the last post-hook (or boundary)."""
        return self._snap

    @property
    def snap_count(self) -> int:
        """The count ``snap`` stands for (-1: none matched)."""
        return self._snap_count

    @property
    def fwd_count(self) -> int:
        """The count at the model's first training forward after a step (its anchor)."""
        return self._fwd_count

    @property
    def fwd_seq(self) -> int:
        """``Hook._book.post_seq`` at the last forward that copied the buffers."""
        return self._fwd_seq

    @property
    def fwd_bufs(self) -> Optional[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
        """(count, buffers) the first forward after a step found."""
        return self._fwd_bufs

    @property
    def fwd_rng(self) -> Optional[tuple[int, torch.Tensor]]:
        """(count, torch RNG) at the first training forward after a step."""
        return self._fwd_rng

    @property
    def range_small(self) -> Any:
        """The small state read at the last proven boundary of an explicit loop (``_copy_small``)."""
        return self._range_small

    @property
    def want_small(self) -> Optional[int]:
        """A round waits for the small state of this step."""
        return self._want_small

    @property
    def want_state(self) -> Optional[int]:
        """A round needs the training thread's read of this step (the exact fallback)."""
        return self._want_state

    @property
    def want_copy(self) -> bool:
        """... as a copy (an ordinary checkpoint; an emergency reads the held live tensors)."""
        return self._want_copy

    @property
    def staged_step(self) -> Optional[int]:
        """The staged save holds the training thread at this step."""
        return self._staged_step

    @property
    def small(self) -> Optional[tuple[int, Any, Any, str]]:
        """The training thread's answer: (step, per-rank blob, param_groups, where)."""
        return self._small

    @property
    def handoff(self) -> Optional[tuple[Any, ...]]:
        """The training thread's read: (step, state dict, bytes, error, where)."""
        return self._handoff

    # ------------------------------------------------------------ checks both sides make

    def snap_at(self, step: int) -> Optional[Snapshot]:
        """The post-hook snapshot of ``step``, if that is the one taken last."""
        return self._snap if self._snap is not None and self._snap_count == step else None

    def rng_at_forward(self, step: int) -> Optional[torch.Tensor]:
        """The torch RNG at the first training forward after ``step``, if one ran since (resume sets it back
        there: ``stephooks._realign_rng``)."""
        return self._fwd_rng[1] if self._fwd_rng is not None and self._fwd_rng[0] == step else None

    def has_small(self, step: int) -> bool:
        """The small state of ``step`` has been handed over."""
        return self._small is not None and self._small[0] == step

    def has_read(self, step: int) -> bool:
        """The training thread's read of ``step`` has been handed over."""
        return self._handoff is not None and self._handoff[0] == step

    def handed(self, step: int, got: Any = None) -> bool:
        """Whether the training thread's read answers a request for ``step``: that step, or the one before
        it read at the end of training (the iteration asked for will never come; the last one's work is over)."""
        got = self._handoff if got is None else got
        return got is not None and (got[0] == step or (got[0] == step - 1 and got[4] == "end-of-training"))

    # ------------------------------------------------------------ the training thread records

    def record_snap(self, snap: Snapshot, count: int) -> None:
        """(no lock: under ``cv`` at a step's end or a proven boundary; without it at the Accelerate adapter's
        resume, no round beside it) The snapshot of the end of iteration ``count``."""
        self._snap, self._snap_count = snap, count

    def record_boundary_snap(self, snap: Snapshot) -> None:
        """(no lock: the boundary path, the training thread) The snapshot of the iteration's end so far, handed to
        the boundary that acts on a notice (no count: ``snap_at`` matches only ``record_snap``'s)."""
        self._snap = snap

    def record_forward_bufs(self, seq: int, count: int, bufs: dict[str, dict[str, torch.Tensor]]) -> None:
        """(no lock at the first forward after a step — ``stephooks._on_forward``; under ``cv`` at an explicit
        loop's boundary) The buffers of the end of iteration ``count``, as found after optimizer step ``seq``."""
        self._fwd_seq = seq
        self._fwd_bufs = (count, bufs)

    def record_forward_rng(self, count: int, rng: torch.Tensor) -> None:
        """(no lock: the first training forward after step ``count``) The torch RNG there."""
        self._fwd_rng = (count, rng)

    def record_forward_count(self, count: int) -> None:
        """(no lock, after the forward's other records) The first training forward after step ``count`` ran:
        the loop's work after that step is over (the anchor of its small state)."""
        self._fwd_count = count

    def record_range_small(self, small: Any) -> None:
        """(under ``cv``) The small state an explicit loop's proven boundary copied (``_copy_small``)."""
        self._range_small = small

    # ------------------------------------------------------------ the training thread answers

    def answer_small(self, small: tuple[int, Any, Any, str]) -> None:
        """(under ``cv``) The small state a round asked for: (step, per-rank blob or None, param_groups, where or
        why not). The caller notifies."""
        self._small = small

    def answer_read(self, got: tuple[Any, ...]) -> None:
        """(under ``cv``) The fallback read a round asked for: (step, state dict or None, bytes, error, where).
        The caller notifies."""
        self._handoff = got

    # ------------------------------------------------------------ the agreement thread's side

    def arm_read(self, step: int, *, copy: bool) -> None:
        """(under ``cv``) Ask the training thread to read the state of ``step`` where it next can."""
        self._handoff = None
        self._want_state = step
        self._want_copy = copy
        self._cv.notify_all()

    def ask_small(self, step: int) -> None:
        """(under ``cv``) A round waits for the small state of ``step``: the training thread reads it at its
        next anchor."""
        self._want_small = step
        self._cv.notify_all()

    def cancel_small(self) -> None:
        """(under ``cv``) The round stops waiting for the small state (what was handed over stays, for
        ``take_small``)."""
        self._want_small = None

    def drop_small(self) -> None:
        """(under ``cv``) The small state asked for or handed over stands no more (the exact fallback asks for
        another step's)."""
        self._small = None
        self._want_small = None

    def hold_staged(self, step: int) -> None:
        """(under ``cv``) The staged save has the tensors of ``step``: the held training thread does not read
        that step's small state again."""
        self._staged_step = step

    def take_read(self) -> Any:
        """(under ``cv``) The training thread's read, taken: the request is over."""
        got, self._handoff, self._want_state = self._handoff, None, None
        return got

    def take_small(self, step: int) -> Any:
        """(under ``cv``) The small state of ``step`` if handed over (else None), taken."""
        got = self._small if self.has_small(step) else None
        self._small = None
        return got

    def clear_wants(self) -> None:
        """(under ``cv``) No request stands any more."""
        self._want_small = self._want_state = None

    def release(self) -> None:
        """(under ``cv``) The round let go of the hold: nothing handed over or asked for stands."""
        self._small = None
        self.clear_wants()
