"""A loop driving ``vote()``/``after_step()`` itself (no GuardedOptimizer) and never calling ``iteration_start()``.

The whole-job leave defers the writer's checkpoint to ``iteration_start()``; such a loop's next
``manager.start_quorum()`` met the shut-down manager (``RuntimeError: cannot schedule new futures after
shutdown``) with nothing written: the whole job lost its state. It now gets the write at the step.
A fake manager stands for torchft's (one group: its SUM all-reduce is the identity).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from spotguard.hook.core import Preempted  # noqa: E402
from spotguard.notice import Notice  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import newest_committed  # noqa: E402
from spotguard.timefmt import utcnow  # noqa: E402
from spotguard.torchft.engine import ReplicaGuard  # noqa: E402


class _Work:
    def wait(self) -> None:
        pass


class _Manager:
    _pg = None

    def __init__(self) -> None:
        self.step = 0
        self.down = False

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Work:
        return _Work()

    def start_quorum(self) -> None:
        if self.down:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def shutdown(self, wait: bool = True) -> None:
        self.down = True

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def _notice(guard: ReplicaGuard) -> None:
    now = utcnow()
    guard.notify(Notice(id="n", source="drill", kind="preemption", deadline=now + timedelta(seconds=60),
                        received_at=now))
    guard.hook._flush_intake()


def _run(tmp: Path, *, call_start: bool) -> tuple[Preempted, list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    mgr = _Manager()
    guard = ReplicaGuard(mgr, {"model": model, "opt": opt, "sched": sched}, str(tmp / "ckpt"),
                         socket=str(tmp / "none.sock"))
    sched_steps: list[int] = []
    try:
        with pytest.raises(Preempted) as exc:
            for i in range(10):
                if call_start:
                    guard.iteration_start()
                mgr.start_quorum()
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                if i == 3:
                    _notice(guard)
                guard.vote()
                committed = bool(mgr.should_commit())
                if committed:
                    opt.step()
                guard.after_step(committed)
                sched.step()
                sched_steps.append(sched.last_epoch)
    finally:
        guard.hook.close()
    return exc.value, sched_steps


def test_a_loop_that_never_calls_iteration_start_still_gets_its_checkpoint(tmp_path: Path) -> None:
    exc, _ = _run(tmp_path, call_start=False)
    assert exc.committed and exc.step == 4
    assert newest_committed(open_storage(str(tmp_path / "ckpt"))) is not None


def test_a_loop_that_calls_iteration_start_gets_the_deferred_write(tmp_path: Path) -> None:
    exc, sched_steps = _run(tmp_path, call_start=True)
    assert exc.committed and exc.step == 4
    assert sched_steps[-1] == 4  # the scheduler step of the leave step ran before the write


@pytest.mark.parametrize("zero_grad_at", ["start", "end"])
def test_guarded_optimizer_writes_after_the_schedulers_step_wherever_zero_grad_is(tmp_path: Path,
                                                                                 zero_grad_at: str) -> None:
    """``opt.step(); opt.zero_grad(); sched.step()`` is as common as zero_grad() first: the writer's checkpoint
    waits for the first training forward after the leave step, so the scheduler's step is in it either way
    (review 3: written in zero_grad(), the zero_grad-last loop resumed one scheduler step behind)."""
    def build() -> tuple[Any, Any, Any, _Manager, ReplicaGuard]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        mgr = _Manager()
        guard = ReplicaGuard(mgr, {"model": model, "opt": opt, "sched": sched}, str(tmp_path / "ckpt"),
                             socket=str(tmp_path / "none.sock"))
        return model, opt, sched, mgr, guard

    model, opt, sched, mgr, guard = build()
    g = guard.optimizer(opt)
    try:
        with pytest.raises(Preempted) as exc:
            for i in range(10):
                if zero_grad_at == "start":
                    g.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                if i == 3:
                    _notice(guard)
                g.step()
                if zero_grad_at == "end":
                    g.zero_grad()
                sched.step()
    finally:
        guard.hook.close()
    assert exc.value.committed and exc.value.step == 4
    _, _, sched2, _, guard2 = build()
    try:
        assert guard2.hook.resume() == 4
        assert sched2.last_epoch == 4 and sched2.get_last_lr() == [0.1 * 0.5 ** 4]  # before: 3 with zero_grad last
    finally:
        guard2.hook.close()
