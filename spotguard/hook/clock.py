"""The step clock: how far the training thread has got, and the hold a background round puts on it.

Why an object of its own (issue 28, part 2): the training thread (the optimizer step hooks in ``stephooks.py``,
the boundaries in ``boundary.py``, the adapters' step callbacks) moves the count and enters/leaves a step; the
agreement thread (``agreement.py``, ``staged.py``'s staged save, ``handoff.py``) reads where it stands, holds it
at a step and releases it; the exit path (``exit.py``) waits on it. Before, that was six names in Hook's one
namespace (``_count``, ``_in_step``, ``_freeze``, ``_target``, ``_hold_until``, ``_cv``) written from five files.
Here they have one owner: its fields are read-only properties, and every change is one of the named moves
below, so this file says every way the clock can change and which of those moves hold ``cv``
(``tests/hook/test_owners.py`` fails on a write from any other file). Every part (the mixins, the adapters, the
torchft engine) reaches it as ``hook._steps`` (``_steps.count``, ``_steps.cv``, ...).

Who does what (the map, read from the code; "(under cv)": the caller holds ``cv``, which is a non-reentrant
Lock, so a move that takes it itself must never be called under it):

- ``count`` — the training thread: ``end_step`` (under cv; ``stephooks._step_end``), ``reach`` (under cv: an
  explicit loop's proven boundary and start in ``boundary.py``, the HF and Lightning any-moment adapters'
  step ends), ``advance`` (no lock: the boundary path's ``boundary._decide``, ``core.py``'s ``range()`` and
  ``step()``), ``set_count`` (no lock: ``resume.py``, ``exit.emergency_exit``, ``boundary._leave_clock``, the
  adapters' ``_base.py``/``hf.py``, the torchft engine and failover; under cv: the DeepSpeed any-moment step
  end). Read by the agreement (``join_round``), the staged save (``wait_reached``), periodic, notices.
- ``in_step`` — the training thread, under cv: ``enter_step`` (``stephooks._step_begin``, an explicit loop's
  several-optimizer step), ``end_step``, ``reach``, ``leave_step`` (``boundary._leave_clock``, the three
  any-moment adapters' hold points). Read by the agreement (``join_round``), the save and the exit.
- ``freeze`` / ``target`` / ``hold_until`` — the agreement thread only: a round joins (``join_round``: no step
  may start at or past the count it stands at), agrees on S (``agree``), bounds or extends the hold
  (``bound_hold``, ``shorten_hold`` from ``notices.py``, ``extend_hold`` from ``handoff.py``), moves it to the
  next iteration (``retarget``, under cv: the exact fallback, ``staged._save_next_iteration``) and lets go
  (``unhold``, under cv: ``stateat._release_hold`` and the staged save). The training thread only reads them
  (``held_at`` in ``_step_begin``, ``hold_left``).
- ``cv`` — guards all of the above and the "state at S" the two threads hand each other (``Hook._state_at``:
  ``handover.py``), which is why it is shared. The no-lock moves are those with no round beside them (the
  boundary path, resume, torchft, an emergency exit) and ``_leave_clock``'s ``set_count``: it comes after a
  bounded wait for a running round, which may still run past it (a later notice shortened the hold), but
  every wait of that round on the count has ended by then or stops at the broken clock (``_handing_over``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from .settings import HOLD_SLACK

__all__ = ["StepClock", "step_of"]


class StepClock:
    """The training thread's step count and in-step flag, and the hold a round puts on them (under ``cv``)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._count = 0  # completed iterations (the step a checkpoint taken now stands for)
        self._in_step = False  # the training thread is inside a step (between its begin and its end)
        self._freeze: Optional[int] = None  # a round runs: no step may start at this count or past it
        self._target: Optional[int] = None  # the agreed step S (held there until its tensors are copied)
        self._hold_until = 0.0  # monotonic bound of the hold (past it plus HOLD_SLACK the held thread gives up)

    # ------------------------------------------------------------ what anyone may read (read-only)

    @property
    def cv(self) -> threading.Condition:
        """The Condition (a non-reentrant Lock) that guards the clock and ``Hook._state_at``."""
        return self._cv

    @property
    def count(self) -> int:
        """Completed iterations: the step a checkpoint taken now stands for."""
        return self._count

    @property
    def in_step(self) -> bool:
        """The training thread is inside a step (between its begin and its end)."""
        return self._in_step

    @property
    def freeze(self) -> Optional[int]:
        """While a round runs: no step may start at this count or past it."""
        return self._freeze

    @property
    def target(self) -> Optional[int]:
        """The agreed step S: the training thread is held there until its tensors are copied."""
        return self._target

    @property
    def hold_until(self) -> float:
        """Monotonic bound of the hold (past it plus HOLD_SLACK the held thread gives up)."""
        return self._hold_until

    # ------------------------------------------------------------ the agreement thread's side

    def join_round(self, t_end: float) -> int:
        """A round joins: from here no step starts past the count this rank stands at, which is returned
        (the count, plus one while a step is in flight: that step ends first)."""
        with self._cv:
            stand = self._count + (1 if self._in_step else 0)
            self._freeze, self._target, self._hold_until = stand, None, t_end
            return stand

    def bound_hold(self, t_end: float) -> None:
        """The agreed earliest deadline bounds the hold from now on."""
        with self._cv:
            self._hold_until = t_end

    def shorten_hold(self, end: float) -> bool:
        """A notice with an earlier deadline joined a running round: True when it shortened the hold."""
        with self._cv:
            if end >= self._hold_until:
                return False
            self._hold_until = end
            self._cv.notify_all()
            return True

    def extend_hold(self, until: float) -> None:
        """Survivors committing alone (handoff.py): a held thread must not give up at the doomed ranks' bound."""
        with self._cv:
            self._hold_until = max(self._hold_until, until)
            self._cv.notify_all()

    def agree(self, step: int) -> None:
        """The round agreed on S: the training thread is held at S (not only short of the freeze)."""
        with self._cv:
            self._target = step
            self._cv.notify_all()

    def unhold(self, keep_target: bool = False) -> None:
        """(under ``cv``) The round lets the training thread step again (``keep_target``: an emergency keeps it
        held at S until the exit). The caller notifies, after clearing what it hands over with it."""
        self._freeze = None
        if not keep_target:
            self._target = None

    def retarget(self, step: int) -> None:
        """(under ``cv``) The exact fallback (``staged.py``: ``_save_next_iteration``): the round's freeze lifts
        and the training thread is held at ``step`` instead (it steps once more, then is held or read there).
        The caller arms the read with it and notifies."""
        self._freeze = None
        self._target = step

    def ended(self, step: int) -> bool:
        """(under ``cv``) This rank has ended ``step`` and is outside a step."""
        return self._count == step and not self._in_step

    def wait_step_end(self, step: int, t_end: float, stop: Callable[[], bool]) -> bool:
        """Wait, bounded by ``t_end``, until this rank has ended ``step`` and is outside a step (held before
        the next); True when it has. ``stop``: (under ``cv``) give up waiting (an exit was requested)."""
        with self._cv:
            while not self.ended(step) and not stop():
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(0.5, left))
            return self.ended(step)

    def wait_reached(self, step: int, t_end: float, stop: Callable[[], bool]) -> bool:
        """Like ``wait_step_end``, but stop waiting once the count is at or past ``step`` outside a step
        (a rank that went past cannot come back); True when it is exactly at ``step``."""
        with self._cv:
            while not (self._count >= step and not self._in_step) and not stop():
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(0.5, left))
            return self.ended(step)

    # ------------------------------------------------------------ the training thread's side

    def held_at(self) -> Optional[int]:
        """(under ``cv``) The count a step may not start at or past: the agreed S, else the round's freeze."""
        return self._target if self._target is not None else self._freeze

    def hold_left(self) -> float:
        """Seconds a held training thread still waits before it gives up (``_give_up_hold``)."""
        return self._hold_until + HOLD_SLACK - time.monotonic()

    def end_step(self) -> int:
        """(under ``cv``) A step ended: count it, leave the step, wake a waiting round; the new count."""
        self._count += 1
        self._in_step = False
        self._cv.notify_all()
        return self._count

    def enter_step(self) -> None:
        """(under ``cv``) The training thread enters a step: a round joining from now on stands at its end."""
        self._in_step = True

    def leave_step(self) -> None:
        """(under ``cv``) The training thread is outside a step again, the count unchanged (an adapter's step
        raised or was not one, the boundary path takes over). The caller notifies where a round may wait."""
        self._in_step = False

    def reach(self, step: int, *, inside: bool = False) -> None:
        """(under ``cv``) The training thread stands at the end of iteration ``step`` (a boundary that counts
        iterations itself: an explicit loop's, an adapter's step end); ``inside``: a step of the next iteration
        already ran. The caller notifies."""
        self._count = step
        self._in_step = inside

    def advance(self) -> int:
        """(no lock: the boundary path, where no round runs beside it) A boundary counted an iteration; the new
        count."""
        self._count += 1
        return self._count

    def set_count(self, step: int) -> None:
        """(no lock: the caller holds ``cv``, or no round runs beside it) The state is now that of ``step``:
        resumed there, an adapter's or torchft's own step number, the step an emergency exit writes."""
        self._count = step


def step_of(hook: Any) -> Optional[int]:
    """The count of ``hook``'s clock, or None before it has one (read defensively: the history writer's step
    callback and the lost-peers exit may run on a hook half built or half torn down)."""
    return getattr(getattr(hook, "_steps", None), "count", None)
