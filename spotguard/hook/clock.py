"""The step clock: how far the training thread has got, and the hold a background round puts on it.

Why an object of its own (issue 28, part 2): the training thread (the optimizer step hooks in ``stephooks.py``,
the boundaries in ``boundary.py``, the adapters' step callbacks) moves the count and enters/leaves a step; the
agreement thread (``agreement.py``, ``staged.py``'s staged save, ``handoff.py``) reads where it stands, holds it
at a step and releases it; the exit path (``exit.py``) waits on it. Before, that was six names in Hook's one namespace (``_count``, ``_in_step``,
``_freeze``, ``_target``, ``_hold_until``, ``_cv``) written from five files. Here they have one owner, and the
moves the two threads make on them are named methods. Every part (the mixins, the adapters, the torchft engine)
reaches it as ``hook._steps`` (``_steps.count``, ``_steps.cv``, ...); the old names are gone.

Who does what (the map, read from the code):

- ``count``: a plain field, written by the training thread (``stephooks.py``: ``end_step`` from ``_step_end``;
  ``boundary.py``: ``_decide``, ``_begin_explicit``, ``_clocked_boundary``, ``_leave_clock``; ``core.py``:
  ``step()``/``range()``; ``resume.py``; ``exit.py``: ``emergency_exit``; the adapters' boundaries; the torchft
  engine); read by the agreement (``join_round``), the staged save (``wait_reached``), periodic, notices.
- ``in_step``: a plain field, the training thread between a step's begin (``_step_begin``) and its end
  (``_step_end``), an explicit loop's boundary (``boundary.py``) or an adapter's own hold point; read by the
  agreement (``join_round``), the save and the exit.
- ``freeze`` / ``target`` / ``hold_until``: the agreement thread only — a round joins (``join_round``: no step
  may start at or past the count it stands at), agrees on S (``agree``), bounds or extends the hold
  (``bound_hold``, ``shorten_hold`` from ``notices.py``, ``extend_hold`` from ``handoff.py``) and lets go
  (``unhold``, from ``stateat.py``'s ``_release_hold`` and the staged save); the exact fallback
  (``staged.py``: ``_save_next_iteration``) sets ``freeze`` and ``target`` directly. The training thread only
  reads them (``held_at`` in ``_step_begin``, ``hold_left``).
- ``cv``: guards all of the above and the "state at S" the two threads hand each other (``Hook._state_at``:
  ``handover.py``), which is why it is shared; the writes of ``count`` on the boundary path, at resume and in
  torchft take no lock (no round runs beside them; docs/architecture.md lists them).
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
        self.cv = threading.Condition(threading.Lock())
        self.count = 0  # completed iterations (the step a checkpoint taken now stands for)
        self.in_step = False  # the training thread is inside a step (between its begin and its end)
        self.freeze: Optional[int] = None  # a round runs: no step may start at this count or past it
        self.target: Optional[int] = None  # the agreed step S (held there until its tensors are copied)
        self.hold_until = 0.0  # monotonic bound of the hold (past it plus HOLD_SLACK the held thread gives up)

    # ------------------------------------------------------------ the agreement thread's side

    def join_round(self, t_end: float) -> int:
        """A round joins: from here no step starts past the count this rank stands at, which is returned
        (the count, plus one while a step is in flight: that step ends first)."""
        with self.cv:
            stand = self.count + (1 if self.in_step else 0)
            self.freeze, self.target, self.hold_until = stand, None, t_end
            return stand

    def bound_hold(self, t_end: float) -> None:
        """The agreed earliest deadline bounds the hold from now on."""
        with self.cv:
            self.hold_until = t_end

    def shorten_hold(self, end: float) -> bool:
        """A notice with an earlier deadline joined a running round: True when it shortened the hold."""
        with self.cv:
            if end >= self.hold_until:
                return False
            self.hold_until = end
            self.cv.notify_all()
            return True

    def extend_hold(self, until: float) -> None:
        """Survivors committing alone (handoff.py): a held thread must not give up at the doomed ranks' bound."""
        with self.cv:
            self.hold_until = max(self.hold_until, until)
            self.cv.notify_all()

    def agree(self, step: int) -> None:
        """The round agreed on S: the training thread is held at S (not only short of the freeze)."""
        with self.cv:
            self.target = step
            self.cv.notify_all()

    def unhold(self, keep_target: bool = False) -> None:
        """(under ``cv``) The round lets the training thread step again (``keep_target``: an emergency keeps it
        held at S until the exit). The caller notifies, after clearing what it hands over with it."""
        self.freeze = None
        if not keep_target:
            self.target = None

    def ended(self, step: int) -> bool:
        """(under ``cv``) This rank has ended ``step`` and is outside a step."""
        return self.count == step and not self.in_step

    def wait_step_end(self, step: int, t_end: float, stop: Callable[[], bool]) -> bool:
        """Wait, bounded by ``t_end``, until this rank has ended ``step`` and is outside a step (held before
        the next); True when it has. ``stop``: (under ``cv``) give up waiting (an exit was requested)."""
        with self.cv:
            while not self.ended(step) and not stop():
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(min(0.5, left))
            return self.ended(step)

    def wait_reached(self, step: int, t_end: float, stop: Callable[[], bool]) -> bool:
        """Like ``wait_step_end``, but stop waiting once the count is at or past ``step`` outside a step
        (a rank that went past cannot come back); True when it is exactly at ``step``."""
        with self.cv:
            while not (self.count >= step and not self.in_step) and not stop():
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(min(0.5, left))
            return self.ended(step)

    # ------------------------------------------------------------ the training thread's side

    def held_at(self) -> Optional[int]:
        """(under ``cv``) The count a step may not start at or past: the agreed S, else the round's freeze."""
        return self.target if self.target is not None else self.freeze

    def hold_left(self) -> float:
        """Seconds a held training thread still waits before it gives up (``_give_up_hold``)."""
        return self.hold_until + HOLD_SLACK - time.monotonic()

    def end_step(self) -> int:
        """(under ``cv``) A step ended: count it, leave the step, wake a waiting round; the new count."""
        self.count += 1
        self.in_step = False
        self.cv.notify_all()
        return self.count


def step_of(hook: Any) -> Optional[int]:
    """The count of ``hook``'s clock, or None before it has one (read defensively: the history writer's step
    callback and the lost-peers exit may run on a hook half built or half torn down)."""
    return getattr(getattr(hook, "_steps", None), "count", None)
