"""A loop that skips ``optimizer.step()`` (a NaN guard) is told so, with the fix, once.

The implicit clock counts optimizer steps; such a loop's iterations outrun the count, so a resume
would train batches twice (the oracle's ``nanskip`` pattern, judged ``limitation-warned``: this warning
must come before the commit). Exactness needs the loop's own clock (``hook.range()``/``hook.step()``);
what the hook can do unasked is say so the moment it sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import structlog
import torch
import torch.nn.functional as F

from spotguard.hook import Hook, events

from .test_boundary import hooks  # noqa: F401 - fixture


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _iterations(s: dict[str, Any], skip: set[int], n: int = 6, zero_first: bool = True, accumulate: int = 1,
                scaler: Any = None) -> None:
    model, opt = s["model"], s["optimizer"]
    for i in range(n):
        if zero_first:
            opt.zero_grad()
        for _ in range(accumulate):
            loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1))
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if i not in skip:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if not zero_first:
            opt.zero_grad()


def _warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == events.OPTIMIZER_STEP_SKIPPED]


@pytest.mark.parametrize("zero_first", [True, False], ids=["zero-grad-first", "zero-grad-last"])
def test_a_skipped_step_is_named_once_with_the_fix(tmp_path: Path, hooks: Callable[..., Hook],  # noqa: F811
                                                  zero_first: bool) -> None:
    s = _state()
    hooks(s, tmp_path).resume()
    with structlog.testing.capture_logs() as logs:
        _iterations(s, skip={2, 4}, zero_first=zero_first)
    found = _warnings(logs)
    assert len(found) == 1, logs
    assert found[0]["step"] == 2  # two steps counted, the third iteration's gradients discarded
    assert "hook.range(total)" in found[0]["fix"]


@pytest.mark.parametrize("case", ["every-step", "accumulation", "explicit-clock"])
def test_loops_that_skip_nothing_are_not_warned(tmp_path: Path, hooks: Callable[..., Hook],  # noqa: F811
                                                case: str) -> None:
    s = _state()
    h = hooks(s, tmp_path)
    with structlog.testing.capture_logs() as logs:
        if case == "explicit-clock":  # hook.range(): the loop's iterations are the clock, a skip is exact
            model, opt = s["model"], s["optimizer"]
            for i in h.range(6):
                opt.zero_grad()
                F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)).backward()
                if i != 3:
                    opt.step()
        else:
            h.resume()
            _iterations(s, skip=set(), accumulate=3 if case == "accumulation" else 1)
    assert _warnings(logs) == []


@pytest.mark.parametrize("case", ["grad-norm-penalty", "explicit-clock-discard"])
def test_gradients_no_backward_left_or_an_explicit_loop_are_not_warned(tmp_path: Path,  # noqa: F811
                                                                       hooks: Callable[..., Hook], case: str) -> None:
    """``torch.autograd.grad`` over the parameters (a gradient-norm penalty) runs the parameters' tensor hooks
    but leaves ``.grad`` alone: it is no backward a zero_grad discarded. An explicit loop (``hook.range()``)
    counts its own iterations, whatever it does with its gradients inside one."""
    s = _state()
    h = hooks(s, tmp_path)
    model, opt = s["model"], s["optimizer"]
    with structlog.testing.capture_logs() as logs:
        if case == "grad-norm-penalty":
            h.resume()
            for _ in range(4):
                opt.zero_grad()
                loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1))
                g = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
                (loss + 0.1 * sum(t.pow(2).sum() for t in g)).backward()
                opt.step()
        else:
            for _ in h.range(4):  # a first backward thrown away inside the iteration, then the real one
                for _ in range(2):
                    opt.zero_grad()
                    F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)).backward()
                opt.step()
    assert _warnings(logs) == []


@pytest.mark.parametrize("case", ["pcgrad", "saliency"])
def test_backwards_that_are_no_discarded_iteration_are_not_warned(tmp_path: Path,  # noqa: F811
                                                                  hooks: Callable[..., Hook], case: str) -> None:
    """PCGrad: one forward, a backward per task with zero_grad() between (their gradients are combined by
    hand). A saliency map in evaluation: ``.backward()`` in eval mode, then ``model.zero_grad()``. Neither is a
    training iteration whose step was skipped (review 3: both warned)."""
    s = _state()
    hooks(s, tmp_path).resume()
    model, opt = s["model"], s["optimizer"]
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            if case == "pcgrad":
                out = model(torch.randn(8, 4))
                grads = []
                for target in (torch.zeros(8, 1), torch.ones(8, 1)):
                    opt.zero_grad()
                    F.mse_loss(out, target).backward(retain_graph=True)
                    grads.append([p.grad.clone() for p in model.parameters()])
                for p, a, b in zip(model.parameters(), *grads):
                    p.grad = a + b
                opt.step()
            else:
                opt.zero_grad()
                F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)).backward()
                opt.step()
                model.eval()
                x = torch.randn(8, 4, requires_grad=True)
                model(x).sum().backward()  # the saliency map: x.grad
                model.zero_grad()
                model.train()
    assert _warnings(logs) == []
