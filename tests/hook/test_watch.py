"""StateWatch (spotguard/hook/watch.py): what proves a background read equals the state at the end of step S."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from spotguard.hook.core import Hook
from spotguard.hook.watch import StateWatch

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_forward_backward_leave_the_mark_intact() -> None:
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    w = StateWatch({"model": m}, {})
    try:
        _step(m, opt)
        w.mark()
        m(torch.randn(8, 4)).sum().backward()  # the next iteration's forward/backward: gradients and BN stats
        assert w.changed() is None
        assert "model" in w.tracked and any(k.endswith("running_mean") for k in w.tracked["model"])
    finally:
        w.close()


def test_writes_outside_step_are_seen() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = StateWatch({"model": m}, {})
    try:
        _step(m, opt)
        p = next(m.parameters())
        w.mark()
        saved = p.detach().clone()
        p.data.copy_(torch.zeros_like(p))  # torch_ema's swap: no _version bump
        assert w.changed() == "Parameter.data was used outside optimizer.step()"
        w.mark()
        with torch.no_grad():
            p.copy_(saved)  # SAM's restore / weight clipping done in place
        assert w.changed() == "a parameter was written outside optimizer.step()"
        w.mark()
        m[0].weight = torch.nn.Parameter(saved.clone())
        assert w.changed() == "a parameter was replaced"
    finally:
        w.close()


_LAST_WATCH = """
import torch
from spotguard.hook.watch import StateWatch, data_accesses
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
assert "data" not in torch.nn.Parameter.__dict__ and data_accesses() is None  # a clean process
a, b = StateWatch({"model": m}, {}), StateWatch({"model": m}, {})
assert "data" in torch.nn.Parameter.__dict__ and data_accesses() is not None
a.close()
assert "data" in torch.nn.Parameter.__dict__  # b still watches
b.close()
assert "data" not in torch.nn.Parameter.__dict__ and data_accesses() is None
p = next(m.parameters())
p.data.mul_(1.0)  # torch's own descriptor again
assert isinstance(p.data, torch.Tensor)
print("ok")
"""


def test_data_watch_is_removed_with_the_last_watch() -> None:
    """In a fresh process: the descriptor is process-wide, and a hook another test left open in this process
    (pytest-xdist puts other modules before this one) would hold a watch of its own."""
    out = subprocess.run([sys.executable, "-c", _LAST_WATCH], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_untracked_training_is_not_nothing_to_save(tmp_path: Path) -> None:
    """SAM-style loops that never call optimizer.step(): the parameters moved with the count still 0, so a
    notice must not report "nothing to save" (143) — _standing says neither nothing nor already (exit 75)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    hook = Hook({"model": m, "optimizer": opt}, str(tmp_path / "ck"), intake=False, signals=False)
    try:
        assert hook._standing(0) == (True, False)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01)  # first_step's perturbation, no optimizer.step()
        assert hook._standing(0) == (False, False)
    finally:
        hook.close()


def test_data_of_parameters_outside_the_dict_does_not_count() -> None:
    """Only the watched models' parameters count: a library using .data on its own parameters (an FSDP
    unsharded copy, a separate evaluation model) does not send every notice to the fallback read."""
    m, other = _model(), _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = StateWatch({"model": m}, {})
    try:
        _step(m, opt)
        w.mark()
        for p in other.parameters():
            p.data.mul_(2.0)
        assert w.changed() is None
        next(m.parameters()).data  # noqa: B018 - a read is enough: it may have been a write
        assert w.changed() == "Parameter.data was used outside optimizer.step()"
    finally:
        w.close()
