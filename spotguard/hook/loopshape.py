"""What the hook has learned about the user's training loop: its shape, and which path acts on a notice.

Why an object of its own (issue 28, part 2, as ``clock.py`` did for the step count): the loop's shape — one
optimizer or several, an implicit loop or an explicit one (``hook.range()``/``hook.step()``), proven against
the optimizer clock or handed to the boundary path, and why — was fifteen names in Hook's one namespace,
initialised in ``core.py`` and read or written by ``boundary.py``, ``stephooks.py``, ``stateat.py``,
``exit.py``, ``agreement.py``, ``resume.py``, ``rounds.py`` and five adapter modules. Here they have one owner,
``Hook._loop``; a field that two files move is moved by a named method, a field one file writes is assigned
there (a record: no property guards a field; ``tests/hook/test_owners.py`` checks that rule). It holds no
lock: the fields are the training thread's, except ``range_broken``, which the agreement thread reads
(``agreement.py``'s round, ``rounds.py``, ``stateat.py:_handing_over``) and the training thread writes under
the clock's ``cv`` (``break_clock``, ``mend_clock``: the caller holds it).

Who does what (the map, read from the code):

- set once here: ``many_opts``, ``opt_key`` (an optimizer -> its key in the hook's dict; a SAM wrapper's base
  counts for the wrapper), ``cycle`` (``cycle.py``: several optimizers in an implicit loop);
  ``boundary_why`` (why this hook acts at iteration boundaries; None: any moment) by ``core.py``'s
  constructor, ``path_logged`` (the ``notice_path`` lines said) by ``core.py:_log_path``;
- ``explicit_intent``: ``core.py`` (``range()``, ``step()``: resume() must not arm the implicit path);
  ``explicit``, ``range_clock``, ``confirmed``, ``step_pattern``, ``kind``: ``boundary.py`` (an explicit
  loop starts, is proven at each boundary, or leaves the clock); read by ``core.py``, ``stephooks.py``,
  ``stateat.py``, ``exit.py``, the Accelerate adapters;
- ``range_broken`` (why an explicit loop's proof failed): ``break_clock`` (``boundary.py:_break_clock``, which
  ``agreement.py``, ``exit.py`` and ``stephooks.py:_step_begin`` call; the Lightning any-moment adapter),
  ``mend_clock`` (the Lightning adapter at a step's end);
- ``iter_steps`` (each optimizer's steps since the last explicit boundary): ``opt_stepped``
  (``stephooks.py``'s post-hook), ``new_iteration`` (``boundary.py``'s boundary);
- ``implicit_counted`` (the optimizer post-hook already counted the iteration a boundary ends):
  ``count_implicit`` (``boundary.py:_decide``, ``stephooks.py:_step_end``), ``take_implicit``
  (``core.py:step()``, ``boundary.py``'s boundaries);
- ``fresh_checked`` (the "first step without resume()" check is done): ``check_fresh`` (``resume.py``, the
  adapters' ``_base.py``); read by ``boundary.py`` and the DeepSpeed/Lightning any-moment adapters.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from .cycle import ImplicitCycle

__all__ = ["LoopShape"]


class LoopShape:
    """The training loop as the hook has seen it (see the module docstring)."""

    def __init__(self, optimizers: Mapping[str, Any], warn: Callable[..., None]) -> None:
        self.many_opts = len(optimizers) > 1
        # Several optimizers in an explicit loop: each one's steps since the last boundary, by its dict name (a
        # SAM wrapper's base counts for the wrapper), and the per-iteration counts the first boundary saw.
        self.opt_key: dict[int, str] = {}
        for name, opt in optimizers.items():
            self.opt_key[id(opt)] = name
            base = getattr(opt, "base_optimizer", None)
            if isinstance(base, torch.optim.Optimizer):
                self.opt_key.setdefault(id(base), name)
        self.iter_steps: dict[str, int] = {}
        self.step_pattern: Optional[dict[str, int]] = None
        # several optimizers in an implicit loop (no hook.range()/hook.step()): where an iteration starts
        self.cycle = ImplicitCycle(lambda o: self.opt_key.get(id(o), "?"), warn)
        self.explicit = False  # an explicit boundary decides (the step hooks are gone)
        self.explicit_intent = False  # the loop said it is explicit (hook.range(), hook.step())
        self.implicit_counted = False
        self.fresh_checked = False
        # An explicit loop (hook.range()/hook.step()) on the any-moment path: the optimizer clock counts, each
        # explicit boundary proves that it ended exactly one clock step (``_clocked_boundary``).
        self.range_clock = False
        self.confirmed = 0  # the count at the last boundary that proved "one clock step per iteration"
        self.range_broken: Optional[str] = None  # why that proof failed (the loop goes back to the boundary path)
        self.kind = "hook.range()"  # the explicit loop's kind, as said in notice_path ("hook.step()")
        self.boundary_why: Optional[str] = None  # why notices are acted on at boundaries (None: any moment)
        self.path_logged: set[tuple[str, str]] = set()

    def key_of(self, optimizer: Any) -> Optional[str]:
        """``optimizer``'s key in the hook's dict (a SAM wrapper's base: the wrapper's), or None."""
        return self.opt_key.get(id(optimizer))

    def opt_stepped(self, optimizer: Any) -> None:
        """An optimizer step ended (post-hook): count it for this iteration under its dict name."""
        name = self.key_of(optimizer)
        if name is not None:
            self.iter_steps[name] = self.iter_steps.get(name, 0) + 1

    def new_iteration(self) -> None:
        """An explicit boundary ended the iteration: no optimizer has stepped in the next one yet."""
        self.iter_steps = {}

    def count_implicit(self) -> None:
        """The optimizer post-hook counted this iteration (a ``hook.step()`` at its end must not count it again)."""
        self.implicit_counted = True

    def take_implicit(self) -> bool:
        """A boundary: whether the post-hook already counted the iteration it ends; from here it has not."""
        counted, self.implicit_counted = self.implicit_counted, False
        return counted

    def break_clock(self, why: str, *, first: bool = True) -> None:
        """(the caller holds ``_steps.cv`` and notifies) The mapping iteration -> optimizer step is disproven;
        the first reason stands (``first=False``: this one replaces it — the Lightning adapter's training start)."""
        if self.range_broken is None or not first:
            self.range_broken = why

    def mend_clock(self) -> None:
        """(the caller holds ``_steps.cv``) The state of the step is known again (the Lightning any-moment
        adapter at a step's end)."""
        self.range_broken = None

    def check_fresh(self) -> None:
        """Whether a run that never resumed starts over a committed checkpoint has been checked (or resumed)."""
        self.fresh_checked = True
