"""The training thread's side of the hook: the optimizer step hooks, the model's forward hook, and what they
do on the any-moment path (enter/leave a step, hold it while a round needs it).

Why a module of its own (issue 28, part 2): these run on the training thread at every step and talk to the rest
of the hook through two owners only — the clock (``clock.py``: ``held_at``, ``hold_left``, ``end_step``,
``wait_step_end``) and the state at S (``stateat.py``: ``_copy_at_anchor``, ``_capture_small_for``,
``_serve_anchor_read``, ``_read_for_round``). Iteration boundaries (``hook.range()``/``hook.step()``, the
boundary path's decide/boundary) are ``boundary.py``; the several-optimizer implicit cycle is ``cycle.py``.
Their own counters and what they installed are ``_book`` (``stepbook.py``); the loop's shape they read and feed
(``_loop.explicit``, ``range_clock``, ``many_opts``, ``opt_stepped``, ``count_implicit``) is ``loopshape.py``.

Who writes what (the map): this module writes ``_book``'s counters (``post_seq``, ``fwd_train_count``,
``bwd_since_step``, ``train_fwd_seq``, ``last_fwd_training``, ``skip_warned``, ``clock``: the one optimizer
that is the clock; ``step_event`` through ``record_step_event``, read by stateat.py's background read; the
handles, shadows and scaler patch through ``keep``/``shadow``/``patch_scaler``/``remove``), records in
``_state_at`` the first forward's buffers, RNG and count (``record_forward_*``; read by stateat.py) and the
post-hook's snapshot (``record_snap``, ``record_boundary_snap``; read by the saves), and ``_bg_on``
(``_turn_on_background``; also cleared by boundary,
exit, agreement, ``close()`` and the DeepSpeed/Lightning any-moment adapters).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import events as ev
from .agreement import agreed_notice
from .dist import NO_DEADLINE_MS
from .outcome import _Result
from .settings import LEVEL_NONE
from .state import Snapshot, clone_buffers

__all__ = ["StepHooksMixin"]


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Never traced by torch.compile (a module hook inside a compiled region would be, with guards on the
    hook's counters: a recompilation every step)."""
    try:
        return torch._dynamo.disable(fn)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - torch without dynamo
        return fn


class StepHooksMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def _install_step_hooks(self) -> None:
        for m in self._objs.models.values():  # and the module a wrapper holds (DDP .module, compile's _orig_mod)
            # (not a compiled module's _orig_mod: dynamo would trace the hook and guard on the hook's counters)
            for mod in {id(x): x for x in (m, getattr(m, "module", None)) if isinstance(x, torch.nn.Module)}.values():
                self._book.keep(mod.register_forward_pre_hook(_eager(self._on_forward)))
        opts = list(self._objs.optimizers.values())
        for opt in list(opts):  # SAM-style wrappers step their base optimizer from first/second_step()
            base = getattr(opt, "base_optimizer", None)
            if isinstance(base, torch.optim.Optimizer) and all(base is not o for o in opts):
                opts.append(base)
                if callable(getattr(opt, "first_step", None)):
                    self._wrap_first_step(opt, base)
        for opt in opts:
            self._book.keep(opt.register_step_pre_hook(self._pre_hook))
            self._book.keep(opt.register_step_post_hook(self._post_hook))
        if len(opts) == 1 and self._warn_skipped_steps:
            self._watch_skipped_steps(opts[0])
        sc = self._book.scaler
        if sc is not None:
            orig_step, orig_update = sc.step, sc.update
            hook = self

            stepped: list[Any] = []  # the optimizers given to step() since the last update(), in order

            def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                if not (hook._internal or hook._loop.explicit or hook._life.closed):
                    if hook._loop.many_opts:
                        stepped.append(optimizer)
                        if not hook._loop.cycle.begins(optimizer, hook._steps.count):
                            return orig_step(optimizer, *args, **kwargs)  # inside an iteration (n_critic, G)
                    if hook._bg_on:
                        hook._step_begin()
                    if hook._agree.pending:
                        hook._boundary()
                return orig_step(optimizer, *args, **kwargs)

            def update(*args: Any, **kwargs: Any) -> Any:
                out = orig_update(*args, **kwargs)
                if not (hook._internal or hook._loop.explicit or hook._life.closed):
                    hook._book.post_seq += 1
                    done = stepped[:]
                    stepped.clear()
                    # several optimizers: the implicit cycle rule over the steps this update() closes (an AMP
                    # WGAN must update() after each D step: a second step(opt_d) before it raises), so each
                    # update() is no iteration of its own
                    ends = [hook._cycle_end(o) for o in done] if hook._loop.many_opts else [True]
                    if any(ends):
                        hook._decide()
                return out

            self._book.patch_scaler(step, update, (orig_step, orig_update))

    def _watch_skipped_steps(self, opt: torch.optim.Optimizer) -> None:
        """Say so when the loop skips ``optimizer.step()`` (a NaN guard: backward, no step, ``zero_grad()``):
        the implicit clock counts optimizer steps, so ``hook.resume()`` would return fewer than the loop's
        iterations and ``range(start, total)`` would train some batches twice. Seen in the next backward:
        gradients the last backward left are gone (``None``) and no step came in between. One optimizer only
        (a GAN's generator legitimately loses the gradients the discriminator's loss gave it)."""
        first = next((p for g in opt.param_groups for p in g["params"]
                      if isinstance(p, torch.Tensor) and p.requires_grad), None)
        if first is None:
            return
        hook, book = self, self._book
        was_none = [False]
        # (training forwards counted at the last backward, was that backward's forward a training one): a
        # backward counts only when a training forward came since the last one and that one was training too —
        # PCGrad's per-task backwards share one forward, a saliency pass runs in eval mode (review 3)
        last = [-1, False]

        def before_grad(grad: torch.Tensor) -> None:
            # every gradient computed for ``first``: ``torch.autograd.grad`` too, which leaves ``.grad`` alone
            was_none[0] = first.grad is None

        def on_grad(param: torch.Tensor) -> None:
            # a backward's accumulation into ``.grad`` only (register_post_accumulate_grad_hook): an
            # ``autograd.grad`` over the parameters (a gradient-norm penalty) is no backward whose gradients a
            # zero_grad could discard; explicit loops (hook.range()/hook.step()) count iterations themselves
            fresh, prev_training = book.train_fwd_seq != last[0], last[1]
            last[0], last[1] = book.train_fwd_seq, book.last_fwd_training
            if book.bwd_since_step and was_none[0] and fresh and prev_training and not book.skip_warned \
                    and not hook._loop.explicit and not hook._loop.range_clock and not hook._loop.explicit_intent \
                    and not hook._internal and book.scaler is None:
                book.skip_warned = True
                hook._log.warning(ev.OPTIMIZER_STEP_SKIPPED, step=hook._steps.count,
                                  why="gradients of a backward were discarded (zero_grad) without an "
                                      "optimizer.step(): hook.resume() counts optimizer steps, not your loop's "
                                      "iterations, so a resumed range(start, total) would train some batches "
                                      "again and the run would not equal the uninterrupted one",
                                  fix="for step in hook.range(total): ... (or call hook.step() at the end of "
                                      "each iteration): the loop's own iterations become the clock; if a "
                                      "GradScaler skips the steps (fp16), pass it in the hook's dict")
            book.bwd_since_step = True

        book.keep(first.register_hook(before_grad))
        book.keep(first.register_post_accumulate_grad_hook(on_grad))

    def _wrap_first_step(self, opt: Any, base: torch.optim.Optimizer) -> None:
        """SAM: the update spans ``first_step()`` (perturb the weights, keep the old ones in the wrapper's
        state) .. ``second_step()`` (restore, ``base_optimizer.step()``). The step begins at ``first_step``:
        a notice in between waits for the step to end, as one inside ``optimizer.step()`` does (the
        wrapper's state at the end of the previous iteration is gone by then)."""
        orig = opt.first_step
        hook = self

        def first_step(*args: Any, **kwargs: Any) -> Any:
            hook._pre_hook(base, args, kwargs)
            return orig(*args, **kwargs)

        opt.first_step = first_step
        self._book.shadow(opt, "first_step")

    def _remove_step_hooks(self) -> None:
        self._book.remove()

    def _on_forward(self, module: Any, args: Any) -> None:
        """Model forward pre-hook: the first *training* forward after step S — one that builds a graph (grad
        enabled; train or eval mode: fine-tuning with frozen BatchNorm) — marks the end of the loop's
        post-step work (its anchor). Not a forward under no_grad/inference_mode: an evaluation's, after which
        a loop may still change its state (``ReduceLROnPlateau.step(val_loss)``, a best-metric tracker) as
        part of iteration S. The buffers of the end of S are those the first forward that may change them
        found: any train-mode forward, no_grad included (a pseudo-label or teacher pass updates BatchNorm)."""
        if self._internal:
            return
        grad = torch.is_grad_enabled()
        book = self._book
        book.last_fwd_training = module.training and grad
        if book.last_fwd_training:
            book.train_fwd_seq += 1
        if not module.training and not grad:
            return  # an evaluation's forward (eval mode, no grad): the iteration's post-step work goes on
        if self._state_at.fwd_seq != book.post_seq:  # the first forward after an optimizer step: buffers of the end
            # of the iteration (post-step updates in, this forward's not yet)
            self._state_at.record_forward_bufs(book.post_seq, self._steps.count, clone_buffers(self._buffers))
        if book.fwd_train_count != self._steps.count and module.training:
            book.fwd_train_count = self._steps.count
            if book.realign is not None:
                self._realign_rng()
            if self._bg_on:  # one optimizer: its step ends the iteration (not so with a GAN's two)
                self._state_at.record_forward_rng(self._steps.count, torch.get_rng_state())  # ~1 us: see _realign_rng
            if self._bg_on and self._steps.count > 0 and not self._loop.range_clock:
                self._watch.mark()  # the post-step writes (AveragedModel, clipping) are part of iteration S
        if self._state_at.fwd_count == self._steps.count or not self._bg_on or not grad:
            return
        self._state_at.record_forward_count(self._steps.count)
        give_up = None
        with self._steps.cv:
            if not self._loop.range_clock:
                # What the loop may still change before the next step (a running-loss meter), copied here
                # every iteration: a round that starts later must not read that change into S.
                self._copy_at_anchor(self._steps.count)
            if self._state_at.want_small == self._steps.count and self._anchor_ok(self._steps.count):  # a round waits: read it here
                self._capture_small_for(self._steps.count, "forward")
            if not self._loop.range_clock:
                # the exact fallback's read (_save_next_iteration)
                give_up = self._serve_anchor_read(self._steps.count, "forward")
        if give_up is not None:
            self._give_up_hold(give_up)
        self._exit_if_requested()

    def _realign_rng(self) -> None:
        """First training forward after a resume: the torch RNG must be what the interrupted run had at its
        first training forward after step S (saved as ``rng_at_forward``). Anything that drew from the global
        RNG between the resume and here and did not draw in the uninterrupted run — typically a DataLoader
        iterator built without its own ``generator=`` — would shift every dropout mask after it."""
        saved = self._book.take_realign()
        if saved is None or torch.equal(torch.get_rng_state(), saved):
            return
        torch.set_rng_state(saved)
        self._log.warning(ev.RNG_REALIGNED, step=self._steps.count,
                          why="the global torch RNG was drawn from between the resume and the first forward "
                              "(a DataLoader iterator without its own generator=?); the torch RNG was set back "
                              "to the interrupted run's, but whatever consumed that draw (a loader that shuffles "
                              "or has workers with it) got other seeds than the uninterrupted run",
                          fix="DataLoader(..., generator=torch.Generator().manual_seed(SEED)), or a stateful "
                              "loader / spotguard.data.ElasticDistributedSampler in the hook's dict")

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._loop.explicit or self._life.detached():
            return  # DCP's fake step() on a fresh optimizer lands here: never count it
        if self._loop.range_clock and self._loop.many_opts:
            self._multi_step_begin(optimizer)
            return
        if self._loop.many_opts:
            if self._book.scaler is not None or not self._loop.cycle.begins(optimizer, self._steps.count):
                return  # the scaler's step() wrapper counts (it sees steps the scaler skips); inside the iteration
        else:
            if self._book.clock is None:
                self._book.clock = optimizer
            if optimizer is not self._book.clock:
                return
        if not self._bg_on and self._bg is not None and not self._loop.explicit_intent and not self._loop.many_opts:
            self._enable_background()  # no hook.resume(): the first step is where training shows itself
        if self._bg_on and self._book.scaler is None:  # with a scaler, its step() wrapper is the begin
            self._step_begin()
        if self._agree.pending:
            self._boundary()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._loop.explicit or self._life.detached():
            return
        self._book.post_seq += 1
        self._book.bwd_since_step = False
        if self._loop.many_opts:  # each optimizer's steps since the last explicit boundary (_multi_boundary_why)
            self._loop.opt_stepped(optimizer)
            if self._loop.range_clock:
                return  # the explicit loop's boundary ends the iteration
        if self._book.scaler is not None:
            return  # GradScaler.update() is the clock
        if not self._loop.many_opts:
            if optimizer is self._book.clock:
                self._decide()
        elif self._cycle_end(optimizer):
            self._decide()

    def _cycle_end(self, optimizer: Any) -> bool:
        """Several optimizers, implicit loop: a step ended; True at the iteration's first clock step (decide),
        else the snapshot follows the iteration's end so far."""
        if self._loop.cycle.ends(optimizer):
            return True
        self._state_at.record_boundary_snap(Snapshot.take(self._objs.loaders))
        return False

    def _iterations_unproven(self, steps: dict[str, int], first: dict[str, int], clock_steps: int,
                             clock_first: int, why: str, **kind: Any) -> None:
        """The ``iterations_unproven`` warning (each of its kinds is said once by its caller)."""
        self._log.warning(ev.ITERATIONS_UNPROVEN, step=self._steps.count, steps=steps, first=first,
                          clock_steps=clock_steps, clock_first=clock_first, **kind,
                          why="several optimizers in a loop without hook.range()/hook.step(): " + why,
                          fix="for i in hook.range(total) (or hook.step() at each iteration's end): the loop's own "
                              "boundaries count its iterations")

    def _enable_background(self, clocked: bool = False) -> None:
        """From now on notices are agreed off the training thread (see agreement.py): implicit loops, and
        explicit ones whose boundaries are checked against the optimizer clock (``clocked``)."""
        self._bg_ready.set()  # training starts here: a round may read this rank's count and resume state
        if self._bg is None or not self._bg.ok or self._loop.explicit or self._bg_on or \
                (self._loop.explicit_intent and not clocked):
            return
        if not clocked and self._implicit_why() is not None:
            return  # said in the second iteration (a hook.step() loop declares itself at the first's end)
        if not clocked:
            self._log_path("any-moment", "implicit", "one optimizer: its step hooks mark each iteration's end")
        self._turn_on_background()

    def _turn_on_background(self) -> None:
        """Notices wake the agreement thread from now on; those that came before training started (warm-up,
        resume) wake it now."""
        self._bg_on = True
        with self._lock:
            notices = list(self._pending.values())
        for n in notices:
            self._arm_wake(n)

    def _step_begin(self, enter: Optional[Callable[[], None]] = None) -> None:
        """Clock pre-hook (background mode): mark "inside optimizer.step", unless a round holds this step.

        While a round runs (``_steps.freeze``: the count this rank said it will stand at)
        or after it agreed ``_steps.target`` = S and this rank is at S, the step waits
        until the tensors of S are copied — for an emergency, until the exit (the
        small state of S is captured here first when this thread arrives before
        the copy is done). Bounded: past the round's deadline without a decision,
        a copy or an exit, the process exits 75. ``enter``: called under ``_steps.cv``
        instead of marking "inside optimizer.step" (an adapter's other hold point).
        """
        give_up = None
        with self._steps.cv:
            while not self._life.exit_requested:
                key = self._steps.held_at()
                if key is None or self._steps.count < key:
                    if enter is None:
                        self._steps.enter_step()
                    else:
                        enter()
                    return
                if self._steps.count == key and not self._anchor_ok(key):
                    # an explicit loop's second optimizer step in one iteration: no boundary proved `key`
                    self._break_clock("two optimizer steps in one iteration: optimizer steps do not map one to "
                                      "one onto iterations")
                elif self._steps.count == key:
                    if self._state_at.staged_step != key and not self._state_at.has_small(key):
                        self._capture_small_for(key, "pre-hook")
                    if self._state_at.want_state == key and not self._state_at.has_read(key) and \
                            self._state_at.fwd_count != key:  # past the anchor, this iteration's writes are in
                        self._read_for_round(key)  # a loop whose forwards the hook does not see
                left = self._steps.hold_left()
                if left <= 0:
                    give_up = key
                    break
                self._steps.cv.wait(min(0.5, left))
        if give_up is not None:
            self._give_up_hold(give_up)
        self._exit_if_requested()

    def _wait_step_end(self, step: int, t_end: float) -> bool:
        """(agreement thread) Wait, bounded by ``t_end``, until this rank has ended ``step`` and is outside a
        step (held before the next); True when it has."""
        return self._steps.wait_step_end(step, t_end, lambda: self._life.exit_requested)

    def _give_up_hold(self, step: int) -> None:
        """Training thread, held past the round's bound (outside ``_steps.cv``): leave with 75 rather than train on."""
        if self._life.exit_requested:
            return
        self._log.error(ev.PEERS_LOST, where="hold", step=step,
                        error="the agreement or the copy did not finish within the notice deadline")
        notice = self._best_notice() or agreed_notice(step, 0, "peers lost while holding the step")  # due now
        self._exit(notice, _Result(committed=False, peers_ok=False, error="hold timed out"), step)

    def _anchor_ok(self, step: int) -> bool:
        """May the small state of ``step`` be read now? Always in an implicit loop; in an explicit one only
        once the loop's boundary has proven that ``step`` ends an iteration (``_clocked_boundary``)."""
        return not self._loop.range_clock or self._loop.confirmed == step

    def _step_end(self) -> None:
        """Clock post-hook (background mode): count, snapshot, leave "inside optimizer.step"."""
        self._watch.mark()  # after step S: what a background read must still see (may track more buffers)
        # before the count: a round may read it at once (an explicit loop: taken at its boundary instead)
        snap = None if self._loop.range_clock else Snapshot.take(self._objs.loaders)
        self._book.record_step_event()  # the background read waits on it: step S's kernels are done
        with self._steps.cv:
            count = self._steps.end_step()
            if snap is not None:
                self._state_at.record_snap(snap, count)
        self._loop.count_implicit()
        if self._periodic is not None:  # the step-path reduction only carries periodic votes now
            if self._agree.pending:
                self._agree.collect()
            self._agree.launch(LEVEL_NONE, NO_DEADLINE_MS, self._periodic_flags())
        self._exit_if_requested()
