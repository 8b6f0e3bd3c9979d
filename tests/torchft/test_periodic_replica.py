"""Issue 25: ``ReplicaGuard(every=, keep=)`` — periodic checkpoints from the one group with replica rank 0.

Before, ``every``/``keep`` were not passed through: storage only ever held whole-job-leave checkpoints and a
crash went back to step 0. A fake manager (tests/torchft/_fallback_worker.py) stands for torchft's; the state is
replicated, so a group with replica rank 1 must write nothing, and the group with rank 0 checkpoints that resume
bitwise to the state recorded after their step (the loop's post-step work included).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import scan  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _fallback_worker as w  # noqa: E402

sys.path.pop(0)


def _train(tmp: Path, *, rank: int, steps: int, every: float, keep: Any, rank1_from: int = 0,
           pause: float = 0.02) -> dict[int, str]:
    model, opt, sched, mgr, guard = w.build(str(tmp / "ckpt"), str(tmp / "none.sock"), every=every, keep=keep)
    # rank1_from: from the quorum of that step on another group has replica rank 0 (a quorum change)
    mgr.participating_rank = lambda: 1 if rank1_from and mgr.step >= rank1_from else rank  # type: ignore[method-assign]
    g = guard.optimizer(opt)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    seen: dict[int, str] = {}
    try:
        for _ in range(steps):
            g.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            assert g.step()
            sched.step()
            seen[mgr.step] = w.digest(model, opt, sched)
            time.sleep(pause)  # the loop's other work (an upload of the last periodic checkpoint ends meanwhile)
    finally:
        guard.close()  # waits for an upload in flight
    return seen


def test_the_group_with_replica_rank_0_writes_periodic_checkpoints_that_resume_bitwise(tmp_path: Path) -> None:
    seen = _train(tmp_path, rank=0, steps=40, every=0.15, keep=None)
    committed = [c for c in scan(open_storage(str(tmp_path / "ckpt"))) if c.committed]
    assert len(committed) >= 2, committed
    assert all(c.record is not None and c.record.reason == "periodic" for c in committed)
    for c in committed[:1] + committed[-1:]:  # the first and the newest
        model, opt, sched, mgr, guard = w.build(str(tmp_path / "ckpt"), str(tmp_path / "none.sock"))
        try:
            assert guard.hook._load(c.dir) is None
            assert w.digest(model, opt, sched) == seen[c.step], c.step
        finally:
            guard.hook.close()


def test_keep_bounds_them_and_other_groups_write_none(tmp_path: Path) -> None:
    _train(tmp_path / "r0", rank=0, steps=40, every=0.1, keep=2)
    kept = [c for c in scan(open_storage(str(tmp_path / "r0" / "ckpt"))) if c.committed]
    assert 1 <= len(kept) <= 2, kept
    _train(tmp_path / "r1", rank=1, steps=40, every=0.1, keep=2)
    assert not [c for c in scan(open_storage(str(tmp_path / "r1" / "ckpt"))) if c.committed]


def test_after_a_quorum_change_the_former_rank_0_writes_no_step_of_the_new_quorum(tmp_path: Path) -> None:
    # the writer is decided by the quorum that committed the step written (before: the one of the step before,
    # so the former rank 0 still wrote step 10, the first step of a quorum where another group has rank 0 —
    # that group may write the same step folder)
    _train(tmp_path, rank=0, steps=14, every=0.01, keep=None, rank1_from=10, pause=0.5)
    steps = [c.step for c in scan(open_storage(str(tmp_path / "ckpt"))) if c.committed]
    assert steps and max(steps) <= 9, steps


def test_a_scheduler_can_be_built_on_the_guarded_optimizer(tmp_path: Path) -> None:
    """Issue 25: GuardedOptimizer was not an Optimizer — ``LambdaLR(guard.optimizer(opt))`` raised TypeError."""
    model, opt, _, mgr, guard = w.build(str(tmp_path / "ckpt"), str(tmp_path / "none.sock"))
    g = guard.optimizer(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(g, lambda s: 0.5 ** s)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    try:
        assert isinstance(g, torch.optim.Optimizer) and g.param_groups is opt.param_groups
        for _ in range(3):
            g.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            assert g.step()
            sched.step()
        assert mgr.step == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 3)
        assert g.state_dict()["state"] and g.state is opt.state
    finally:
        guard.close()


class _Registry:
    """torchft's Manager.register_state_dict_fn / _user_state_dicts, as the fake manager lacks them."""

    def __init__(self) -> None:
        self._user_state_dicts: dict[str, Any] = {}
        self._load_state_dict_fns: dict[str, Any] = {}

    def register_state_dict_fn(self, key: str, load: Any, state: Any) -> None:
        assert key not in self._user_state_dicts
        self._load_state_dict_fns[key], self._user_state_dicts[key] = load, state


def test_the_guard_declares_what_a_heal_transports_scheduler_included(tmp_path: Path) -> None:
    """Issue 25: state was declared twice (the Manager's callbacks and the guard's dict): a Manager whose
    callbacks forgot the scheduler healed a replacement with a fresh one. The guard now registers its own
    dict's replicated items with the Manager, and a healed group gets the survivor's scheduler."""
    def group(name: str) -> tuple[Any, Any, Any, Any, Any]:
        orig = w.Manager.__init__

        def init(self: Any) -> None:
            orig(self)
            _Registry.__init__(self)  # type: ignore[arg-type]

        w.Manager.__init__ = init  # type: ignore[method-assign]
        w.Manager.register_state_dict_fn = _Registry.register_state_dict_fn  # type: ignore[attr-defined]
        try:
            model, opt, sched, mgr, guard = w.build(str(tmp_path / name), str(tmp_path / "none.sock"))
        finally:
            w.Manager.__init__ = orig  # type: ignore[method-assign]
            del w.Manager.register_state_dict_fn  # type: ignore[attr-defined]
        return model, opt, sched, mgr, guard

    model, opt, sched, mgr, guard = group("a")
    model2, opt2, sched2, mgr2, guard2 = group("b")
    try:
        assert set(mgr._user_state_dicts) == {"spotguard"}
        g = guard.optimizer(opt)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        for _ in range(4):
            g.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            g.step()
            sched.step()
        sent = mgr._user_state_dicts["spotguard"]()
        assert set(sent) == {"model", "opt", "sched"}
        mgr2._load_state_dict_fns["spotguard"](sent)  # what torchft does with a survivor's state on a heal
        assert w.digest(model2, opt2, sched2) == w.digest(model, opt, sched)
        assert sched2.last_epoch == 4
    finally:
        guard.close()
        guard2.close()

