"""Review of the refusal (issue 25): loops real torchft users write, against the commit gate and the step check.

False negatives: LocalSGD on an optimizer the guard's dict does not hold (a Stateful app object holding model and
optimizer, the DCP pattern; a second optimizer) trained ``sync_every - 1`` inner steps before the gate refused it
at the first sync, naming no LocalSGD; torchft's ``OptimizerWrapper`` in the dict failed with an AttributeError.
False positives / leaks at ``close()``: a ``should_commit`` wrapper set before the guard was dropped, one set after
it kept refusing after the guard closed, closing one of two guards on a manager unguarded the other, and a guard
built after a closed one healed with the closed guard's objects. The fake manager is test_local_sync_refused's.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402
from torchft.local_sgd import LocalSGD  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

from spotguard.torchft.engine import ReplicaGuard, UnsupportedLoop  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import test_local_sync_refused as base  # noqa: E402

sys.path.pop(0)


def _guard(tmp: Path, mgr: Any, state: dict[str, Any], name: str = "g") -> ReplicaGuard:
    return ReplicaGuard(mgr, state, str(tmp / f"ckpt-{name}"), socket=str(tmp / f"{name}.sock"))


def _close(*guards: ReplicaGuard) -> None:
    for g in guards:
        g._done.set()
        g.close()


class _App:
    """A DCP-style Stateful holding model and optimizer: the guard's dict has no optimizer of its own."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])


@pytest.mark.parametrize("held", ["stateful-app", "other-optimizer"])
def test_local_sgd_on_an_optimizer_the_guard_does_not_hold_is_refused_at_its_first_step(tmp_path: Path,
                                                                                         held: str) -> None:
    model, opt, mgr = base._setup()
    mgr.voters = 1  # one group: the fake SUM is the identity (LocalSGD all-reduces parameters through it)
    if held == "stateful-app":
        guard, inner = _guard(tmp_path, mgr, {"app": _App(model, opt)}), opt
    else:
        guard, inner = _guard(tmp_path, mgr, {"model": model, "opt": opt}), torch.optim.SGD(model.parameters(), 0.1)
    taken = 0
    try:
        with pytest.raises(UnsupportedLoop) as refused, LocalSGD(mgr, model, inner, sync_every=4):
            for _ in range(6):
                base._train_step(model, inner)
                taken += 1
        assert (refused.value.what, taken, mgr.commits) == ("LocalSGD", 0, 0)
    finally:
        _close(guard)


def test_torchft_optimizer_wrapper_in_the_guards_dict_is_refused_at_install(tmp_path: Path) -> None:
    model, opt, mgr = base._setup()
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(UnsupportedLoop) as refused:  # was: AttributeError '_optimizer_step_pre_hooks'
        _guard(tmp_path, mgr, {"model": model, "opt": OptimizerWrapper(mgr, opt)})
    assert refused.value.what == "OptimizerWrapper" and "guard.optimizer(inner)" in refused.value.fix
    assert signal.getsignal(signal.SIGTERM) == handler and "should_commit" not in vars(mgr)


def test_close_gives_back_a_should_commit_wrapper_set_before_the_guard(tmp_path: Path) -> None:
    model, opt, mgr = base._setup()
    real, seen = mgr.should_commit, []

    def counted(*a: Any, **k: Any) -> bool:
        seen.append(1)
        return real(*a, **k)

    mgr.should_commit = counted  # type: ignore[method-assign]  # e.g. a metrics wrapper
    _close(_guard(tmp_path, mgr, {"model": model, "opt": opt}))
    assert mgr.should_commit is counted and mgr.should_commit() and seen == [1]


def test_after_close_a_wrapper_set_over_the_gate_commits_unrefused(tmp_path: Path) -> None:
    model, opt, mgr = base._setup()
    guard = _guard(tmp_path, mgr, {"model": model, "opt": opt})
    gated = mgr.should_commit
    mgr.should_commit = lambda *a, **k: gated(*a, **k)  # type: ignore[method-assign]  # set after the guard
    _close(guard)
    assert base._train_step(model, OptimizerWrapper(mgr, opt)) is None and mgr.commits == 1  # unguarded now


def test_closing_one_of_two_guards_on_a_manager_keeps_the_gate_for_the_other(tmp_path: Path) -> None:
    model, opt, mgr = base._setup()
    first = _guard(tmp_path, mgr, {"model": model, "opt": opt}, "a")
    model2 = torch.nn.Linear(8, 1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.05)
    second = _guard(tmp_path, mgr, {"model": model2, "opt": opt2}, "b")
    try:
        _close(first)
        with pytest.raises(UnsupportedLoop):
            base._train_step(model2, OptimizerWrapper(mgr, opt2))
        assert mgr.commits == 0
        assert base._train_step(model2, second.optimizer(opt2)) is True
    finally:
        _close(second)
    assert "should_commit" not in vars(mgr)


def test_a_guard_built_after_a_closed_one_heals_with_its_own_objects(tmp_path: Path) -> None:
    model, opt, mgr = base._setup()
    _close(_guard(tmp_path, mgr, {"model": model, "opt": opt}, "a"))
    model2 = torch.nn.Linear(8, 1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.05)
    second = _guard(tmp_path, mgr, {"model": model2, "opt": opt2}, "b")
    try:
        base._train_step(model2, second.optimizer(opt2))
        sent = mgr._user_state_dicts["spotguard"]()  # what a healing group would get from this one
        assert torch.equal(sent["model"]["weight"], model2.weight)
        assert not torch.equal(sent["model"]["weight"], model.weight)
    finally:
        _close(second)


def test_a_step_whose_commit_raised_is_retried_with_a_fresh_vote(tmp_path: Path) -> None:
    """torchft's ``should_commit`` raises after ``max_retries`` failures; a loop that catches it and retries
    the step votes again: never refused (the gate is disarmed by the failed call, armed by the new vote)."""
    model, opt, mgr = base._setup()
    guard = _guard(tmp_path, mgr, {"model": model, "opt": opt})
    real, calls = guard._commit_gate._real, []

    def flaky(*a: Any, **k: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("should_commit failed 3 times consecutively, exceeding max_retries=2")
        return real(*a, **k)

    guard._commit_gate._real = flaky
    gopt, out = guard.optimizer(opt), []
    try:
        for _ in range(3):
            try:
                out.append(base._train_step(model, gopt))
            except UnsupportedLoop:
                raise
            except RuntimeError:
                out.append("failed")
        assert out == [True, "failed", True] and mgr.step == 2
    finally:
        _close(guard)


def test_a_subclass_is_refused_and_after_close_local_sgd_runs_unguarded(tmp_path: Path) -> None:
    """A LocalSGD subclass (its own sync) is refused at its first step; the refusal's fix (close the guard, run
    LocalSGD without it) then trains and syncs: nothing of the guard is left on the manager or the optimizer."""

    class Logged(LocalSGD):
        def sync(self) -> None:
            super().sync()

    model, opt, mgr = base._setup()
    mgr.voters = 1
    guard = _guard(tmp_path, mgr, {"model": model, "opt": opt})
    with pytest.raises(UnsupportedLoop) as refused, Logged(mgr, model, opt, sync_every=2):
        base._train_step(model, opt)
    _close(guard)
    assert refused.value.what == "LocalSGD" and mgr.commits == 0
    with Logged(mgr, model, opt, sync_every=2):
        for _ in range(4):
            base._train_step(model, opt)
    assert mgr.commits == 2 and mgr.step == 2


@pytest.mark.parametrize("loop", ["manual", "guarded"])
def test_a_vote_of_an_iteration_given_up_does_not_carry_a_later_unvoted_commit(tmp_path: Path, loop: str) -> None:
    """The loop votes, then raises before ``should_commit`` (a NaN check, an OOM in clipping), catches it and
    starts the next iteration; a ``should_commit()`` with no vote of its own there was let through."""
    model, opt, mgr = base._setup()
    guard = _guard(tmp_path, mgr, {"model": model, "opt": opt})
    try:
        mgr.start_quorum()
        guard.vote()  # ... and the iteration is given up before should_commit
        if loop == "manual":
            guard.iteration_start()
        else:
            guard.optimizer(opt).zero_grad()
        with pytest.raises(UnsupportedLoop):
            mgr.should_commit()
        assert mgr.commits == 0
    finally:
        _close(guard)
