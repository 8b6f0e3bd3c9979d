"""Several optimizers in a loop without ``hook.range()``/``hook.step()``: where an iteration starts.

The rule: an iteration starts at a step of the *clock* (the first optimizer that stepped, a GAN's D) that
follows another optimizer's step; the clock's further steps before that (WGAN's n_critic D steps) are inside
the iteration — never counted, never a boundary. What the step sequence cannot prove is said once each, as
``iterations_unproven`` (docs/api.md "Several optimizers").

Why an object of its own (issue 28, part 2): the rule is fed from two places — the optimizers' step hooks and a
``GradScaler``'s ``step(opt)``/``update()`` wrappers (which see the steps the scaler skips on inf/nan) — and its
state (the clock, the first iteration's pattern, what was already said) has no other reader.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["ImplicitCycle"]


class ImplicitCycle:
    """The iteration starts of an implicit loop with several optimizers; ``begins``/``ends`` bracket each step."""

    def __init__(self, name_of: Callable[[Any], str], warn: Callable[..., None]) -> None:
        self.clock: Optional[Any] = None  # the first optimizer that stepped
        self._name_of = name_of  # an optimizer -> its key in the hook's dict
        self._warn = warn  # Hook._iterations_unproven(steps, first, clock_steps, clock_first, why, **kind)
        self._seen = False  # the clock has ended one iteration-starting step
        self._start = False  # the clock's step in flight starts an iteration (begins -> ends)
        self._others: dict[str, int] = {}  # the other optimizers' steps in the current iteration
        self._clock_steps = 0  # the clock's steps in the current iteration (n_critic)
        self._pattern: Optional[tuple[int, dict[str, int]]] = None  # the first iteration's (clock, others)
        self._confirmed = False  # a later iteration stepped like the first one
        self._warned = False
        self._unconfirmed_warned = False

    def begins(self, optimizer: Any, count: int) -> bool:
        """A step of ``optimizer`` begins (its pre-hook, or ``scaler.step(optimizer)``): True when it starts an
        iteration — the hook's boundary. ``count``: the iterations counted so far (for what is said)."""
        if self.clock is None:
            self.clock = optimizer
        if optimizer is not self.clock:
            return False
        self._start = not self._seen or bool(self._others)
        if self._start and self._seen:
            self._check(count)
        return self._start

    def ends(self, optimizer: Any) -> bool:
        """A step of ``optimizer`` ended (its post-hook, or the ``scaler.update()`` that closes it): True when it
        is the iteration's first clock step, where the hook decides (counts, launches the agreement)."""
        if optimizer is self.clock and self._start:
            self._start, self._seen, self._others, self._clock_steps = False, True, {}, 1
            return True
        if optimizer is self.clock:
            self._clock_steps += 1
        else:
            name = self._name_of(optimizer)
            self._others[name] = self._others.get(name, 0) + 1
        return False

    def before_commit(self) -> None:
        """A commit at an implicit boundary before any iteration stepped like the first one: the count rests on
        one iteration (D skipped in iteration 1 merges 0 and 1 unseen), so say so first (once; review ganrev)."""
        if self._confirmed or self._warned or self._unconfirmed_warned:
            return
        self._unconfirmed_warned = True
        clock, first = self._pattern if self._pattern is not None else (0, {})
        self._warn(first, first, clock, clock,
                   "the checkpoint's iteration count rests on the first iteration alone (no later one has stepped "
                   "like it yet), so a skipped or an extra step there would go unseen", confirmed=False)

    def _check(self, count: int) -> None:
        """An iteration ended: the optimizers stepped as in the first one, or the count is no longer proven."""
        got = dict(self._others)
        if self._pattern is None:
            self._pattern = (self._clock_steps, got)
            if self._clock_steps > 1:
                self._ambiguous(got)
            return
        first_clock, first = self._pattern
        if (self._clock_steps, got) == self._pattern:
            self._confirmed = True
        elif not self._warned:
            # the clock's own steps count too: a G warm-up (G alone, then D, G) or PyTorch-GAN's wgan.py (G every
            # n_critic batches, the first at batch 0) differ there only (review ganrev)
            self._warned = True
            self._warn(got, first, self._clock_steps, first_clock,
                       "the hook counts an iteration at each step of the first optimizer that follows another "
                       f"optimizer's; the others stepped {got} in iteration {count}, {first} in the first (the "
                       f"clock {self._clock_steps} and {first_clock} times: a skipped or an extra step), so the "
                       "iteration count the checkpoints carry may differ from the loop's")

    def _ambiguous(self, others: dict[str, int]) -> None:
        """The first iteration stepped the clock more than once before another optimizer: WGAN's n_critic D steps
        of one iteration, or one D step per iteration with G every n-th (PyTorch-GAN's wgan.py, G at
        ``i % n == n - 1``) — the step sequence is the same. The hook counts the former; said once, at the end of
        the first iteration, before any commit (review ganrev)."""
        n = self._clock_steps
        self._warn(others, others, n, n,
                   f"the first optimizer stepped {n} times before the others stepped {others}; the hook counts that "
                   f"as one iteration (WGAN's n_critic), but a loop whose iteration is one step of it, with the "
                   f"others every {n}th iteration, looks the same, and its checkpoints would carry {n} times fewer "
                   "iterations than the loop ran", ambiguous=True)
