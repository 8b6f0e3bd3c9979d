"""Fast single-process tests of the hook's boundary logic (no torchrun, no daemon).

A single process acts on notices at any moment by default (issue 23; ``test_anymoment_loops.py``): these
tests pin the boundary path, which adapters, several optimizers and loops whose optimizer steps do not map
onto iterations still take, with ``SPOTGUARD_BACKGROUND_AGREEMENT=0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import structlog
import torch
import torch.nn.functional as F

from spotguard import install_preemption_hook
from spotguard.hook import Hook, Preempted, events, parse_every
from spotguard.hook import exit as exit_mod
from spotguard.hook.state import classify
from spotguard.notice import Notice
from spotguard.storage import open_storage
from spotguard.storage.commit import newest_committed, scan, step_dir
from spotguard.timefmt import utcnow


class Loader:
    """A stateful per-rank loader: batch ``pos`` is a pure function of pos."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        x = torch.randn(8, 6, generator=g)
        return x, x.sum(dim=1, keepdim=True).tanh()

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


class Ema:
    """A 'stateful' object updated after the step (read at the boundary)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: torch.nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].mul_(0.9).add_(v.detach(), alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        return {k: v.clone() for k, v in self.shadow.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in sd.items()}


def make(opt_kind: str = "sgd") -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt: torch.optim.Optimizer
    if opt_kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    return {"model": model, "optimizer": opt, "scheduler": sched, "loader": Loader(), "ema": Ema(model)}


def one_iteration(s: dict[str, Any]) -> None:
    """The exact loop of the issue: opt.step(); sched.step() with dropout and RNG in the math."""
    x, y = next(s["loader"])
    s["optimizer"].zero_grad(set_to_none=True)
    noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
    loss = F.mse_loss(s["model"](x) * noise, y)
    loss.backward()
    s["optimizer"].step()
    s["scheduler"].step()
    s["ema"].update(s["model"])


def snapshot(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in s["model"].state_dict().items()},
        "optimizer": s["optimizer"].state_dict(),
        "scheduler": s["scheduler"].state_dict(),
        "ema": s["ema"].state_dict(),
        "loader": s["loader"].state_dict(),
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"differs at {path}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"keys differ at {path}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{path}[{i}]")
    else:
        assert a == b, f"differs at {path}: {a!r} != {b!r}"


def reference(total: int, opt_kind: str = "sgd") -> dict[str, Any]:
    s = make(opt_kind)
    for _ in range(total):
        one_iteration(s)
    return snapshot(s)


def notice(kind: str = "preemption", nid: str | None = None) -> Notice:
    now = utcnow()
    return Notice(id=nid or f"drill-{uuid.uuid4().hex[:12]}", source="drill", kind=kind,
                  deadline=now + timedelta(seconds=30), received_at=now)


@contextlib.contextmanager
def boundary_path() -> Iterator[None]:
    """Hooks built inside act at iteration boundaries (the variable is read at construction only, so nothing
    leaks into the processes a test starts). Why in-process tests need it: on the any-moment path a process
    that caught ``Preempted`` and went on is ended by the hook's backstop (``os._exit``) — pytest included."""
    old = os.environ.get("SPOTGUARD_BACKGROUND_AGREEMENT")
    os.environ["SPOTGUARD_BACKGROUND_AGREEMENT"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPOTGUARD_BACKGROUND_AGREEMENT", None)
        else:
            os.environ["SPOTGUARD_BACKGROUND_AGREEMENT"] = old


@pytest.fixture
def hooks() -> Iterator[Callable[..., Hook]]:
    """Hooks on the boundary path (other test files import this fixture for their step-exact scenarios)."""
    made: list[Hook] = []

    def factory(state: dict[str, Any], storage: Any, **kw: Any) -> Hook:
        kw.setdefault("signals", False)
        kw.setdefault("intake", False)
        with boundary_path():
            h = Hook(state, str(storage), **kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


def run_until_preempted(hook: Hook, s: dict[str, Any], total: int, notify_at: int, n: Notice) -> Preempted:
    start = hook.resume()
    for i in range(start, total):
        if i == notify_at:
            hook.notify(n)
        try:
            one_iteration(s)
        except Preempted as exc:
            return exc
    raise AssertionError("the hook never preempted")


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("notify_at", [0, 4, 9])
def test_implicit_loop_resumes_bitwise(tmp_path: Path, hooks: Callable[..., Hook], opt_kind: str, notify_at: int) -> None:
    total = 12
    ref = reference(total, opt_kind)
    s = make(opt_kind)
    n = notice()
    with structlog.testing.capture_logs() as logs:
        exc = run_until_preempted(hooks(s, tmp_path), s, total, notify_at, n)
    assert exc.code == 143 and exc.committed and exc.notice_id == n.id
    # Decided at the optimizer step of iteration notify_at; written at the next step's pre-hook.
    assert exc.step == notify_at + 1
    names = [e["event"] for e in logs if e.get("component") == "hook"]
    for name in (events.AGREED, events.CHECKPOINT_STARTED, events.CHECKPOINT_COMMITTED, events.TEARDOWN, events.EXIT):
        assert name in names
    info = newest_committed(open_storage(str(tmp_path)))
    assert info is not None and info.step == notify_at + 1 and info.record.notice_id == n.id

    s2 = make(opt_kind)
    h2 = hooks(s2, tmp_path)
    start = h2.resume()
    assert start == notify_at + 1 and h2.iteration == start
    for _ in range(start, total):
        one_iteration(s2)
    assert_same(ref, snapshot(s2))


def test_explicit_range_resumes_bitwise(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    total = 10
    ref = reference(total)
    s = make()
    h = hooks(s, tmp_path)
    with pytest.raises(Preempted) as info:
        for i in h.range(total):
            if i == 3:
                h.notify(notice())
            one_iteration(s)
    # Flag launched at the end of iteration 3, read at the end of iteration 4.
    assert info.value.step == 5
    s2 = make()
    h2 = hooks(s2, tmp_path)
    steps = []
    for i in h2.range(total):
        steps.append(i)
        one_iteration(s2)
    assert steps[0] == 5 and steps[-1] == total - 1
    assert_same(ref, snapshot(s2))


def test_hook_step_after_optimizer_hooks_counts_once(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    h = hooks(s, tmp_path)
    assert h.resume() == 0
    for _ in range(3):
        one_iteration(s)
        h.step()
    assert h.iteration == 3


def test_fake_step_on_fresh_optimizer_is_not_counted(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make("adam")
    h = hooks(s, tmp_path)
    assert run_until_preempted(h, s, 10, 2, notice()).step == 3
    s2 = make("adam")
    h2 = hooks(s2, tmp_path)
    calls: list[int] = []
    s2["optimizer"].register_step_post_hook(lambda *a: calls.append(1))
    assert h2.resume() == 3
    assert calls, "set_optimizer_state_dict is expected to run a fake step() on a fresh optimizer"
    assert h2.iteration == 3 and not h2._agree.pending  # the fake step neither counted nor launched


def test_gradscaler_counts_skipped_steps(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    scaler = torch.amp.GradScaler("cpu")
    s["scaler"] = scaler
    h = hooks(s, tmp_path)
    h.resume()
    for i in range(4):
        x, y = next(s["loader"])
        s["optimizer"].zero_grad()
        scaler.scale(F.mse_loss(s["model"](x), y)).backward()
        if i == 1:
            for p in s["model"].parameters():
                p.grad.fill_(float("inf"))
        scaler.step(s["optimizer"])
        scaler.update()
        s["scheduler"].step()
    assert h.iteration == 4  # one optimizer.step() skipped on inf, four iterations counted
    h.notify(notice())
    x, y = next(s["loader"])
    s["optimizer"].zero_grad()
    scaler.scale(F.mse_loss(s["model"](x), y)).backward()
    scaler.step(s["optimizer"])
    scaler.update()  # decision
    with pytest.raises(Preempted) as info:
        scaler.step(s["optimizer"])  # boundary: the next scaler.step()
    assert info.value.step == 5
    h.close()
    assert "update" not in vars(scaler)  # the instance wrapper is gone


def test_replayed_notice_exits_at_resume(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    n = notice()
    run_until_preempted(hooks(s, tmp_path), s, 10, 1, n)
    s2 = make()
    h2 = hooks(s2, tmp_path)
    h2.notify(n)  # the daemon replays the same notice to the restarted process
    with structlog.testing.capture_logs() as logs, pytest.raises(Preempted) as info:
        h2.resume()
    assert info.value.code == 143 and info.value.step == 2
    assert [e for e in logs if e["event"] == events.AGREED][0]["action"] == "exit"
    assert not any(e["event"] == events.CHECKPOINT_STARTED for e in logs)
    assert [c.step for c in scan(open_storage(str(tmp_path)))] == [2]


def test_replayed_notice_after_resume_exits_without_second_checkpoint(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    n = notice()
    run_until_preempted(hooks(s, tmp_path), s, 10, 1, n)
    s2 = make()
    h2 = hooks(s2, tmp_path)
    assert h2.resume() == 2
    h2.notify(n)  # arrives later (daemon connected after resume); agreed before any progress is saved
    with pytest.raises(Preempted):
        for _ in range(3):
            one_iteration(s2)
    assert len(scan(open_storage(str(tmp_path)))) <= 2


def test_notice_after_last_step_lets_job_finish(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    h = hooks(s, tmp_path)
    with structlog.testing.capture_logs() as logs:
        for i in h.range(5):
            if i == 4:
                h.notify(notice())
            one_iteration(s)
        h._at_exit()
    assert any(e["event"] == events.NOTICE_AFTER_LAST_STEP for e in logs)
    assert scan(open_storage(str(tmp_path))) == []


def test_rebalance_takes_ordinary_checkpoint_and_keeps_training(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    h = hooks(s, tmp_path)
    h.resume()
    n = notice("rebalance")
    for i in range(6):
        if i == 1:
            h.notify(n)
        one_iteration(s)
    infos = scan(open_storage(str(tmp_path)))
    assert [(i.step, i.record.reason, i.record.notice_id) for i in infos] == [(2, "manual", n.id)]
    assert h.iteration == 6


def test_on_notice_false_ignores_notice(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    seen: list[str] = []

    def policy(n: Notice) -> bool:
        seen.append(n.id)
        return False

    s = make()
    h = hooks(s, tmp_path, on_notice=policy)
    h.resume()
    h.notify(notice())
    for _ in range(3):
        one_iteration(s)
    assert len(seen) == 1 and scan(open_storage(str(tmp_path))) == []


def test_keep_retention_never_deletes_newest(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    h = hooks(s, tmp_path, keep=1)
    h.resume()
    for i in range(8):
        if i in (1, 4):
            h.notify(notice("maintenance"))
        one_iteration(s)
    assert [c.step for c in scan(open_storage(str(tmp_path)))] == [5]


def test_corrupt_newer_checkpoints_are_never_loaded(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    total = 10
    ref = reference(total)
    s = make()
    run_until_preempted(hooks(s, tmp_path), s, total, 2, notice())  # committed at step 3
    good = tmp_path / step_dir(3)
    # step 6: garbage commit record; step 8: a valid-looking record but a truncated shard.
    bad = tmp_path / step_dir(6)
    bad.mkdir()
    for f in good.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "COMMIT.json").write_text("{not json")
    trunc = tmp_path / step_dir(8)
    trunc.mkdir()
    for f in good.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    rec = json.loads((good / "COMMIT.json").read_text())
    rec["step"] = 8
    (trunc / "COMMIT.json").write_text(json.dumps(rec))
    shard = next(p for p in trunc.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "latest").write_text(step_dir(8) + "\n")
    s2 = make()
    h2 = hooks(s2, tmp_path)
    assert h2.resume() == 3
    for _ in range(3, total):
        one_iteration(s2)
    assert_same(ref, snapshot(s2))


def test_sigusr1_chains_previous_handler(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    called: list[int] = []
    prev = signal.signal(signal.SIGUSR1, lambda signum, frame: called.append(signum))
    try:
        s = make()
        h = hooks(s, tmp_path, signals=True)
        h.resume()
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(50):  # the handler hands off to a thread
            if h._pending:
                break
            threading.Event().wait(0.01)
        assert called == [signal.SIGUSR1]
        with pytest.raises(Preempted) as info:
            for _ in range(3):
                one_iteration(s)
        assert info.value.code == 143
        # leaving: late signals swallowed by a Python handler, not SIG_IGN (which a child inherits)
        assert signal.getsignal(signal.SIGUSR1) is exit_mod._swallow
        assert signal.getsignal(signal.SIGTERM) is exit_mod._swallow
        child = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGTERM)))"],
                               capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == str(int(signal.SIG_DFL)), "a process that caught Preempted must not start SIGTERM-deaf children"
    finally:
        signal.signal(signal.SIGUSR1, prev)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_classification_by_protocol_not_name() -> None:
    s = make()
    objs = classify({"m": s["model"], "o": s["optimizer"], "lr": s["scheduler"], "data": s["loader"],
                     "ema": s["ema"]})
    assert objs.roles() == {"m": "model", "o": "optimizer", "lr": "scheduler", "data": "loader", "ema": "stateful"}
    with pytest.raises(TypeError, match="without state_dict"):
        classify({"model": s["model"], "steps": 3})
    with pytest.raises(TypeError, match="no single nn.Module"):
        classify({"optimizer": s["optimizer"]})


def test_install_dispatch_and_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="supported: a dict of stateful objects"):
        install_preemption_hook(object(), storage=str(tmp_path))
    h = install_preemption_hook(make(), storage=str(tmp_path), every="15m", socket=str(tmp_path / "absent.sock"))
    try:  # periodic checkpoints (tests/hook/test_periodic.py): a duration, numbers are seconds
        assert h._periodic is not None and h._periodic.every == 900
    finally:
        h.close()
    with pytest.raises(ValueError):
        install_preemption_hook(make(), storage=str(tmp_path), every="soon")
    with pytest.raises(ValueError):
        install_preemption_hook(make(), storage=str(tmp_path), keep=0)
    assert parse_every("1h30m") == 5400 and parse_every(90) == 90 and parse_every(None) is None
    assert issubclass(Preempted, SystemExit) and Preempted().code == 143


def test_install_without_daemon_works(tmp_path: Path) -> None:
    s = make()
    h = install_preemption_hook(s, storage=str(tmp_path), socket=str(tmp_path / "absent.sock"))
    try:
        assert isinstance(h, Hook) and h.resume() == 0
        one_iteration(s)
        assert h.iteration == 1
    finally:
        h.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
