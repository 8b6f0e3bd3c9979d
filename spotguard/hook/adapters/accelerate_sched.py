"""Accelerate: schedulers stepped at the iteration's top (before the forward, the pre-1.1 PyTorch order).

Why: the implicit loop reads the end of iteration S at its anchor, the first training forward after S, because a
scheduler is normally stepped after ``optimizer.step()``. A loop that steps it at the top of each iteration has
stepped it for S+1 before that forward: the checkpoint held it (and the ``lr`` it wrote into the optimizer's
``param_groups``) one step ahead, and the resumed loop stepped it again at its top.

Detected, not guessed: no scheduler steps before the first training forward of a run (or of a resume) in the
usual order; one that did is stepped at the top (PyTorch warns about the same call). Decided at that forward, not
at the first ``optimizer.step()``: with ``step_scheduler_with_optimizer=False`` and accumulation the usual order
steps the scheduler after each micro-batch's (skipped) ``opt.step()``, before the first real one (review obrev:
taken for the top order, S's scheduler was saved without its last micro-batch's step). Decided at the first
``optimizer.step()`` only where no training forward was seen (an explicit ``hook.range()`` loop). Then the schedulers' state
dicts and every ``param_group``'s values but ``params`` are copied at each optimizer post-hook (a few hundred bytes:
nothing moves them between the top of an iteration and its optimizer step), and a checkpoint of S holds those
copies — the background writer's (``_per_rank_state``, ``_capture_small``) and ``save_state``'s on the boundary path
(``rewound``: loaded for the save, the live state put back). Said once (``notice_path`` stays; a warning
``scheduler_at_iteration_top`` names it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from .. import events as ev
from ..state import copy_state

__all__ = ["TopSchedulers"]


def _inner(accelerator: Any) -> list[Any]:
    return [getattr(s, "scheduler", s) for s in getattr(accelerator, "_schedulers", [])]


class TopSchedulers:
    """The prepared schedulers as at each optimizer post-hook, once they are found stepped at the top."""

    def __init__(self, accelerator: Any, log: Any) -> None:
        self.acc, self._logger = accelerator, log
        self.top: Optional[bool] = None  # decided at the first optimizer step after install / a resume
        self._base = self._counts()
        self._at: Optional[tuple[int, list[dict[str, Any]], list[list[dict[str, Any]]]]] = None

    def _counts(self) -> list[Any]:
        return [getattr(s, "_step_count", getattr(s, "last_epoch", None)) for s in _inner(self.acc)]

    def rebase(self) -> None:
        """After a resume's ``load_state``: the first optimizer step from here decides again."""
        self._base, self.top = self._counts(), None

    def forward(self, count: int) -> None:
        """The first training forward of the prepared model after install / a resume decides (module docstring)."""
        if self.top is None:
            self._decide(count)

    def step(self, count: int) -> None:
        """Each optimizer post-hook of step ``count``."""
        if self.top is None:
            self._decide(count)
        if self.top:
            self._at = (count, [copy_state(s.state_dict()) for s in _inner(self.acc)], self._groups())

    def _decide(self, count: int) -> None:
        self.top = self._counts() != self._base
        if self.top:
            self._logger().warning(ev.SCHEDULER_AT_ITERATION_TOP, step=count,
                                   why="a scheduler was stepped before the first training forward: stepped at the "
                                       "top of each iteration, so its state (and lr) of step S is read at S's "
                                       "optimizer step, not at the next forward",
                                   fix="step the scheduler after optimizer.step() (the PyTorch >= 1.1 order), or "
                                       "loop over hook.range(total)")

    def _groups(self) -> list[list[dict[str, Any]]]:
        return [[{n: copy_state(v) for n, v in g.items() if n != "params"} for g in getattr(o, "optimizer", o)
                 .param_groups] for o in getattr(self.acc, "_optimizers", [])]

    def of(self, step: int) -> Optional[tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]]:
        """(scheduler state dicts, param_groups without params) of ``step``; None when not stepped at the top."""
        return (self._at[1], self._at[2]) if self.top and self._at is not None and self._at[0] == step else None

    @contextlib.contextmanager
    def rewound(self, step: int) -> Iterator[None]:
        """For ``save_state`` on the training thread: the schedulers and param_groups as at ``step``'s post-hook."""
        at = self.of(step)
        if at is None:
            yield
            return
        scheds = _inner(self.acc)
        live = [copy_state(s.state_dict()) for s in scheds], self._groups()
        self._load(scheds, *at)
        try:
            yield
        finally:
            self._load(scheds, *live)

    def _load(self, scheds: list[Any], states: list[dict[str, Any]], groups: list[list[dict[str, Any]]]) -> None:
        for s, st in zip(scheds, states):
            s.load_state_dict(st)
        for o, gs in zip(getattr(self.acc, "_optimizers", []), groups):
            for g, saved in zip(getattr(o, "optimizer", o).param_groups, gs):
                g.update(saved)
