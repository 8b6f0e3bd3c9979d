"""Issue 25: torchft's LocalSGD/DiLoCo are refused when the guard is built or at the first step, not at the notice.

They call ``manager.should_commit()`` inside the inner optimizer's post-hook every ``sync_every`` steps, so the
leave vote never runs (refusal.py says why they are not supported). Before, the guard said so only at the notice
(``replica_not_voting``), after the job had trained with a guard that could not act. In-process, the fake manager
of ``_fallback_worker.py`` with what LocalSGD/DiLoCo need of a manager; the LocalSGD/DiLoCo classes are torchft's.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("torchft")

import structlog  # noqa: E402
import torch  # noqa: E402
from torchft.local_sgd import DiLoCo, LocalSGD  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

from spotguard.torchft.engine import REFUSED, ReplicaGuard, UnsupportedLoop  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _fallback_worker as w  # noqa: E402
import _local_sync_worker as real  # noqa: E402

sys.path.pop(0)


class _Manager(w.Manager):
    """The fake manager plus what torchft's LocalSGD/DiLoCo call on one."""

    _use_async_quorum = False  # DiLoCo requires a synchronous quorum

    def __init__(self) -> None:
        super().__init__()
        self._user_state_dicts: dict[str, Any] = {}
        self.commits = 0  # calls that reached the manager's own should_commit

    def should_commit(self) -> bool:
        self.commits += 1
        return super().should_commit()

    def register_state_dict_fn(self, key: str, load: Callable[..., Any], save: Callable[[], Any]) -> None:
        self._user_state_dicts[key] = save

    def disallow_state_dict_read(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, _Manager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05), _Manager()


def _guard(tmp: Path, mgr: _Manager, model: torch.nn.Module, opt: torch.optim.Optimizer) -> ReplicaGuard:
    return ReplicaGuard(mgr, {"model": model, "opt": opt}, str(tmp / "ckpt"), socket=str(tmp / "none.sock"))


def _train_step(model: torch.nn.Module, opt: Any) -> Any:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 1)).backward()
    return opt.step()


def _diloco(mgr: _Manager, model: torch.nn.Module, opt: torch.optim.Optimizer) -> DiLoCo:
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return DiLoCo(mgr, [model], opt, outer, sync_every=2)


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo"])
def test_local_sync_entered_after_the_guard_is_refused_at_its_first_step(tmp_path: Path, kind: str) -> None:
    model, opt, mgr = _setup()
    guard = _guard(tmp_path, mgr, model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    algo = LocalSGD(mgr, model, opt, sync_every=2) if kind == "LocalSGD" else _diloco(mgr, model, opt)
    try:
        with structlog.testing.capture_logs() as logs, algo:
            with pytest.raises(UnsupportedLoop) as refused:
                _train_step(model, opt)
        assert refused.value.what == kind and "should_commit" in str(refused.value)
        assert "guard.optimizer(opt)" in refused.value.fix
        # refused before the inner step and before any sync: nothing trained, nothing committed
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert mgr.commits == 0 and mgr.step == 0
        events = [e for e in logs if e["event"] == REFUSED]
        assert events and events[0]["what"] == kind and events[0]["fix"]
    finally:
        guard._done.set()
        guard.close()


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo"])
def test_local_sync_set_up_before_the_guard_is_refused_at_install(tmp_path: Path, kind: str) -> None:
    model, opt, mgr = _setup()
    handler = signal.getsignal(signal.SIGTERM)
    if kind == "LocalSGD":
        algo: Any = LocalSGD(mgr, model, opt, sync_every=2)
        algo.__enter__()  # its step hooks are on the optimizer
    else:
        algo = _diloco(mgr, model, opt)  # built, not entered: its fragment state is on the manager
    with pytest.raises(UnsupportedLoop) as refused:
        _guard(tmp_path, mgr, model, opt)
    assert refused.value.what == kind
    # the half-built guard let go of everything: the signal handler, the manager's should_commit
    assert signal.getsignal(signal.SIGTERM) == handler
    assert "should_commit" not in vars(mgr)
    if kind == "LocalSGD":
        algo.__exit__(None, None, None)


def test_torchft_optimizer_wrapper_is_refused_at_its_first_commit_the_guarded_loop_is_not(tmp_path: Path) -> None:
    """torchft's ``OptimizerWrapper`` calls ``should_commit()`` without the vote (as LocalSGD on an optimizer
    the guard does not hold would): refused at that call, before the manager's own commit. The guard's own
    optimizer votes first, so its steps commit; after ``close()`` the manager has its own method back."""
    model, opt, mgr = _setup()
    guard = _guard(tmp_path, mgr, model, opt)
    try:
        with pytest.raises(UnsupportedLoop) as refused:
            _train_step(model, OptimizerWrapper(mgr, opt))
        assert refused.value.what == "should_commit without vote" and "guard.vote()" in refused.value.fix
        assert mgr.commits == 0
        guarded = guard.optimizer(opt)
        assert [_train_step(model, guarded) for _ in range(3)] == [True, True, True]
        assert mgr.commits == 3 and mgr.step == 3
    finally:
        guard._done.set()
        guard.close()
    assert "should_commit" not in vars(mgr)




@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One lighthouse process for both cases (its console script imports torch: ~10 s on the loaded machine)."""
    from spotguard.torchft.engine import lighthouse_args  # noqa: PLC0415
    from spotguard.torchft.launch import lighthouse_binary, start_lighthouse  # noqa: PLC0415

    if lighthouse_binary() is None:  # pragma: no cover - the wheel ships it
        pytest.skip("torchft_lighthouse not installed")
    lh = start_lighthouse(lighthouse_args(groups=1, step_seconds=0.5),
                          tmp_path_factory.mktemp("lighthouse") / "lighthouse.log", timeout=60)
    try:
        yield lh.addr
    finally:
        lh.stop()


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo"])
def test_a_real_manager_with_local_sync_is_refused_at_the_first_step(short_tmp: Path, lighthouse: str,
                                                                       kind: str) -> None:
    """torchft's own Manager (its Rust server, gloo) against a lighthouse process: the loop is refused at its
    first inner step, before any sync reached the manager. Before, it trained and synced (2 syncs in 4 steps)."""
    result = real.run(lighthouse, kind, str(short_tmp / "ckpt"), str(short_tmp / "none.sock"), 4)
    assert result == {"refused": kind, "taken": 0, "manager_step": 0, "syncs": 0}, result
