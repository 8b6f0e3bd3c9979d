"""Iteration boundaries: explicit loops (``hook.range()``/``hook.step()``) on the any-moment path, proven
against the optimizer clock, and the boundary path (decide at an iteration's end, act at the next step).

Why a module of its own (issue 28, part 2): a boundary reads the clock (``clock.py``: the count, in-step), takes
the snapshot of the iteration's end for the state at S (``stateat.py``: ``_copy_small``, ``_capture_small_for``,
``_serve_anchor_read``) and launches or collects the flag reduction (``dist.py:Agreement``); acting on an agreed
notice is ``agreement.py`` (``_act``), the periodic save ``staged.py``.

Who writes what (the map): this module writes the loop's shape (``_loop``, ``loopshape.py``: ``confirmed``,
``range_clock``, ``range_broken`` through ``break_clock`` (also the Lightning adapter), ``iter_steps`` through
``new_iteration``, ``step_pattern``, ``explicit``, ``implicit_counted``, ``kind``), ``_state_at.range_small``,
``_book.step_event`` (``record_step_event``), ``_boundary_at``/``_iteration_seconds``; the round (agreement.py)
reads ``_loop.range_broken``, the state at S reads ``_loop.confirmed`` and ``_state_at.range_small``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .dist import NO_DEADLINE_MS
from .settings import HOLD_SLACK, LEVEL_NONE
from .state import Snapshot, clone_buffers

__all__ = ["BoundaryMixin"]


class BoundaryMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def _tick(self) -> None:
        """An iteration boundary: how long the iteration took (the boundary path's warning at a notice)."""
        now = time.monotonic()
        last = getattr(self, "_boundary_at", None)
        if last is not None:
            self._iteration_seconds = now - last
        self._boundary_at = now

    def _decide(self) -> None:
        """End of an iteration as the hook sees it: count, snapshot, launch the flag reduction."""
        self._tick()
        if not self._loop.fresh_checked:
            self._warn_unresumed()
        if self._life.torn_down:  # the process group is gone: count, but launch nothing
            self._steps.advance()
            return
        if self._bg_on:
            self._step_end()
            return
        if self._agree.pending:  # a decision no boundary consumed (unusual loop): settle it here, consistently
            res = self._agree.collect()
            if res is not None and res[0] > 0:
                self._act(res[0], res[1], snap=None, final=False)
        self._steps.advance()
        self._loop.count_implicit()
        if self._loop.many_opts and not self._loop.explicit_intent and \
                ("boundary", "implicit") not in self._loop.path_logged:
            clock = self._loop.key_of(self._loop.cycle.clock)
            if any(n > 0 for k, n in self._loop.iter_steps.items() if k != clock):
                # the clock steps again after another optimizer did: past the first iteration, where a
                # hook.step() loop would have declared itself
                self._log_path("boundary", "implicit", self._implicit_why() or "")
        self._state_at.record_boundary_snap(Snapshot.take(self._objs.loaders))
        level, deadline_ms = self._local_level()
        self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _unconfirmed_cycle(self) -> None:
        """Before a commit at an implicit loop's boundary with several optimizers: ImplicitCycle.before_commit."""
        if self._loop.many_opts and not self._loop.explicit and not self._loop.range_clock:
            self._loop.cycle.before_commit()

    def _boundary(self) -> None:
        res = self._agree.collect()
        self._loop.take_implicit()
        if res is not None and (res[0] > 0 or self._periodic_due()):  # a commit comes
            self._unconfirmed_cycle()
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=self._state_at.snap, final=False)
        elif res is not None:
            self._maybe_periodic(self._state_at.snap)

    def _explicit_boundary(self, *, final: bool) -> None:
        self._tick()
        if not self._loop.fresh_checked:
            self._warn_unresumed()
        if self._life.torn_down:  # after destroy_process_group(): no collective any more
            return
        res = self._agree.collect()
        self._loop.take_implicit()
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=None, final=final)
        elif res is not None and not final:
            self._maybe_periodic(None)
        if not final:
            level, deadline_ms = self._local_level()
            self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _enter_explicit(self) -> None:
        if self._loop.explicit:
            return
        self._loop.explicit = True
        self._loop.range_clock = False
        self._bg_on = False  # the explicit boundary decides (the hook cannot see optimizer steps any more)
        self._remove_step_hooks()

    def _begin_explicit(self, loop: str, start: int) -> None:
        """An explicit loop starts (``hook.range()``, the first ``hook.step()``): any-moment if the optimizer
        clock is observable (one optimizer, the background agreement running), else the boundary path.

        Why the clock can stand for the loop: with one optimizer stepped once per iteration, the end of
        optimizer step S *is* the end of iteration S-1 as far as model and optimizer go, and the loop's
        boundary right after it is where the rest (scheduler, RNG, loader, buffers) is read. Each boundary
        checks that exactly one clock step ran since the previous one (``_clocked_boundary``); a round may
        only save a step that such a check has proven (``_loop.confirmed``).
        """
        if self._loop.explicit or self._loop.range_clock:
            return
        bg = self._bg
        if bg is None or not bg.ok or bg.closed or self._life.torn_down or self._loop.range_broken is not None:
            self._log_path("boundary", loop, self._loop.range_broken or self._loop.boundary_why or
                           "the background agreement is not available")
            self._enter_explicit()
            return
        if self._loop.many_opts and self._agree.pending:
            self._agree.collect()  # a hook.step() loop's first iteration ran on the implicit (boundary) path:
            # every rank launched this reduction; a notice it carries is still pending and is armed below
        with self._steps.cv:
            self._loop.confirmed = start
            self._loop.range_clock = True
            if self._loop.many_opts:  # the count moves at boundaries; steps already in this iteration: inside it
                self._steps.reach(start, inside=bool(self._loop.iter_steps))
                self._step_copies.reset(start)
        self._loop.kind = loop
        self._enable_background(clocked=True)
        if self._loop.many_opts:
            self._log_path("any-moment", loop, f"{len(self._objs.optimizers)} optimizers: each boundary ends an "
                           "iteration and checks that every optimizer stepped as often as in the first one; "
                           "every optimizer's step waits while a round reads the state of the last boundary")
        else:
            self._log_path("any-moment", loop, "one optimizer: its step hooks mark each iteration's end; every "
                                              "boundary checks that exactly one optimizer step ran in the iteration")

    def _clocked_boundary(self, *, final: bool) -> None:
        """The loop's boundary on the any-moment path: prove "one clock step in this iteration", then record
        what the end of the iteration is (RNG, loader, buffers, the watch's mark) and serve a round that waits
        for this step's small state. Any other count hands the loop to the boundary path (``_leave_clock``)."""
        if not self._loop.fresh_checked:
            self._warn_unresumed()
        expected = self._loop.confirmed + 1
        why = self._loop.range_broken
        if why is None and self._loop.many_opts:
            why = self._multi_boundary_why(expected)
        elif why is None and (self._steps.count != expected or self._steps.in_step):
            why = (f"{self._steps.count - self._loop.confirmed} optimizer steps in the iteration that ended at boundary "
                   f"{expected} (gradient accumulation, a skipped or an extra optimizer.step()): optimizer steps "
                   "do not map one to one onto iterations")
        if why is not None:
            self._leave_clock(expected, why, final=final)
            return
        snap = Snapshot.take(self._objs.loaders)
        bufs = clone_buffers(self._buffers)
        self._watch.mark()  # the loop's post-step writes (AveragedModel, clipping) belong to this iteration
        if self._loop.many_opts:
            self._book.record_step_event()  # the background read waits on it: this iteration's kernels are done
        with self._steps.cv:
            if self._loop.many_opts:  # the iteration ends here (``_multi_step_begin``): count it, leave "inside"
                self._steps.reach(expected)
                self._loop.new_iteration()
                self._step_copies.reset(expected)  # (the watch's mark above excused none of the new copies)
            self._state_at.record_snap(snap, expected)
            self._state_at.record_forward_bufs(self._book.post_seq, expected, bufs)
            self._loop.confirmed = expected
            # The small state of this iteration's end, copied here and kept until the next boundary: the one
            # moment it is known exactly (the loop may change a stateful object before its next forward or
            # step). A round for this step takes it whenever it comes — no wait for an anchor. Copied, not
            # packed: packing (torch.save) costs ms, and only a round needs it (``_capture_small_for``).
            self._state_at.record_range_small(self._copy_small(expected, "iteration-boundary"))
            if self._state_at.want_small == expected:
                self._capture_small_for(expected, "iteration-boundary")
            give_up = self._serve_anchor_read(expected, "iteration-boundary")  # the exact fallback's read
            self._steps.cv.notify_all()
        if give_up is not None:
            self._give_up_hold(give_up)
        if self._loop.many_opts and self._periodic is not None and not final:
            # the periodic vote launched at the last boundary is settled here, where the state is this
            # iteration's end: at the next optimizer step, the loop's work before it (a scheduler stepped at
            # the iteration's top, a meter, weights clipped before the critic's forward) would be saved as
            # part of this step
            if self._agree.pending:
                self._boundary()
            self._agree.launch(LEVEL_NONE, NO_DEADLINE_MS, self._periodic_flags())
        self._exit_if_requested()

    def _multi_boundary_why(self, expected: int) -> Optional[str]:
        """Several optimizers: None when every optimizer stepped in the iteration ending at boundary
        ``expected`` as often as in the first iteration of the loop (learned there), else why not — an
        optimizer that did not step carries gradients into the next iteration that no checkpoint holds."""
        steps = dict(self._loop.iter_steps)
        idle = [k for k in self._objs.optimizers if steps.get(k, 0) < 1]
        if idle:
            return (f"optimizer(s) {', '.join(idle)} did not step in the iteration that ended at boundary "
                    f"{expected} (gradient accumulation, a skipped step): the state at that boundary is not an "
                    "iteration's end every optimizer agrees on")
        if self._loop.step_pattern is None:
            self._loop.step_pattern = steps
            return None
        if steps != self._loop.step_pattern:
            return (f"optimizer steps {steps} in the iteration that ended at boundary {expected}, "
                    f"{self._loop.step_pattern} in the first: the iteration's optimizer steps are not regular")
        return None

    def _multi_step_begin(self, optimizer: Any) -> None:
        """Several optimizers in an explicit loop: every optimizer's pre-hook. Any step waits while a round
        holds the count (``_step_begin``), so no optimizer moves past the state a round reads. An optimizer's
        first step of the iteration copies what it will change (``stepcopy.py``): the state of the last
        boundary stays readable, and a round joining later stands there. A step without such a copy (the
        iteration's last one, over the bound, the loop's first iteration) marks "inside the iteration": a round
        joining from then on stands at the next boundary. The periodic vote launched at the last boundary is
        settled at the next boundary."""
        if not self._bg_on:
            return
        self._step_begin(enter=lambda: self._enter_multi(optimizer))

    def _enter_multi(self, optimizer: Any) -> None:
        """(under ``_steps.cv``, not held) ``optimizer`` steps now: keep the last boundary readable, or mark "inside"."""
        if not self._steps.in_step and self._copy_before_step(optimizer):
            return
        self._steps.enter_step()

    def _copy_before_step(self, optimizer: Any) -> bool:
        """True when the state of the last boundary stays readable through ``optimizer``'s step: it already has
        a copy (WGAN's later critic steps), or one is taken now. Not for the iteration's last step (the boundary
        right after it is where a round stands: the post-step work only), nor before the first iteration
        showed the pattern; an optimizer written since the boundary (weight clipping at the iteration's top)
        cannot be copied as it was there."""
        key = self._loop.key_of(optimizer)
        copies = self._step_copies
        pattern = self._loop.step_pattern
        if key is None or pattern is None or copies.step != self._steps.count or self._watch.sharded is not None or \
                self._watch.fsdp:
            return False
        if {**self._loop.iter_steps, key: self._loop.iter_steps.get(key, 0) + 1} == pattern:
            # the iteration's last optimizer step (also a later step of a copied optimizer: D, G, D): from here
            # a round stands at the boundary, and none can stand at the last one while the boundary moves on
            return False
        if copies.has(key):
            return True
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self._watch.untouched(params):
            return False
        owner = self._objs.owner.get(key, "")
        why = copies.before_first_step(key, optimizer, owner, self._objs.models.get(owner))
        if why is not None:
            self._log_path("iteration-end", self._loop.kind,
                           f"a notice after optimizer {key}'s step waits for the iteration's end: {why}")
            return False
        self._watch.excuse(params)
        self._book.record_step_event()  # the background read waits on it: the copies' kernels are done
        return True

    def _break_clock(self, why: str) -> None:
        """(under ``_steps.cv``) The mapping iteration -> optimizer step is disproven: a round waiting for a step
        no boundary proved hands its notice to the boundary path."""
        self._loop.break_clock(why)
        self._steps.cv.notify_all()

    def _leave_clock(self, expected: int, why: str, *, final: bool) -> None:
        """From this boundary on, this loop acts on notices at iteration boundaries (said once, with why).

        A round in flight either saves a step that was proven before (its commit then ends the process
        here) or hands its notice over (it stays pending, and the boundary reduction carries it)."""
        with self._steps.cv:
            self._break_clock(why)
            if self._loop.many_opts:
                self._steps.leave_step()  # the boundary path counts from here (its steps are not watched)
        self._log_path("boundary", self._loop.kind, why)
        bg = self._bg
        if bg is not None and bg.busy.is_set():
            end = max(self._steps.hold_until, time.monotonic()) + HOLD_SLACK
            with self._steps.cv:
                while bg.busy.is_set() and not self._life.exit_requested and time.monotonic() < end:
                    self._steps.cv.wait(0.05)  # `busy` clears without a notify: look again shortly
        self._exit_if_requested()
        self._step_copies.reset(-1)  # the boundary path reads live state at boundaries: no copies any more
        self._steps.set_count(expected)
        self._enter_explicit()
        self._explicit_boundary(final=final)
