"""Which path a loop takes (issue 23), in one process and without notices: ``hook.range()``/``hook.step()``
loops stay on the any-moment path while each boundary proves one optimizer step per iteration, leave it
once (``notice_path`` warning with why) when one does not, and count iterations either way; several
optimizers stay on it while every boundary finds the first iteration's optimizer steps, and say why an implicit
loop of theirs keeps the boundary path. The timing and exactness of a notice on these paths are
``test_anymoment_loops.py``'s (subprocesses: the any-moment path ends the process it runs in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import structlog
import torch

from spotguard.hook import Hook, events


def _state(n_opts: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    out: dict[str, Any] = {"model": m}
    params = list(m.parameters())
    for k in range(n_opts):
        out[f"opt{k}"] = torch.optim.SGD(params[k::n_opts], lr=0.1)
    out["sched"] = torch.optim.lr_scheduler.StepLR(out["opt0"], step_size=2)
    return out


def _iteration(s: dict[str, Any], step: bool) -> None:
    s["model"](torch.randn(6, 4)).square().mean().backward()
    if step:
        for k in sorted(k for k in s if k.startswith("opt")):
            s[k].step()
            s[k].zero_grad()
        s["sched"].step()


@pytest.fixture
def hook_of(tmp_path: Path) -> Iterator[Any]:
    made: list[Hook] = []

    def make(s: dict[str, Any]) -> Hook:
        h = Hook(s, str(tmp_path / f"ck{len(made)}"), signals=False, intake=False)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _paths(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["path"], e["loop"]) for e in logs if e["event"] == events.NOTICE_PATH]


def test_range_with_one_step_per_iteration_stays_any_moment(hook_of: Any) -> None:
    s = _state()
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        for _ in h.range(5):
            _iteration(s, step=True)
    assert _paths(logs) == [("any-moment", "hook.range()")]
    assert h._loop.range_clock and h._bg_on and h.iteration == 5 and h._loop.confirmed == 5
    assert h._state_at.range_small is not None and h._state_at.range_small[0] == 5  # the end of the last iteration, as read there


def test_range_with_accumulation_leaves_the_clock_once_and_counts_iterations(hook_of: Any) -> None:
    s = _state()
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        for i in h.range(6):
            _iteration(s, step=i % 2 == 1)
    assert _paths(logs) == [("any-moment", "hook.range()"), ("boundary", "hook.range()")]
    [line] = [e for e in logs if e["event"] == events.NOTICE_PATH and e["path"] == "boundary"]
    assert line["log_level"] == "warning" and "one to one" in line["why"], line
    assert not h._loop.range_clock and not h._bg_on and h.iteration == 6


def test_two_steps_in_one_iteration_leave_the_clock(hook_of: Any) -> None:
    s = _state()
    h = hook_of(s)
    it = iter(h.range(4))
    next(it)
    _iteration(s, step=True)
    _iteration(s, step=True)  # a second optimizer step in iteration 0
    next(it)  # boundary 1: two clock steps
    assert not h._loop.range_clock and h.iteration == 1 and h._loop.range_broken is not None


def test_hook_step_counts_iterations_on_the_clock(hook_of: Any) -> None:
    s = _state()
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        assert h.resume() == 0
        got = []
        for _ in range(3):
            _iteration(s, step=True)
            got.append(h.step())
    assert got == [1, 2, 3] and h._loop.range_clock
    assert _paths(logs) == [("any-moment", "implicit"), ("any-moment", "hook.step()")]


def test_several_optimizers_in_range_stay_any_moment(hook_of: Any) -> None:
    """Two optimizers in ``hook.range``: the boundary ends each iteration and finds both stepped once."""
    s = _state(n_opts=2)
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        for _ in h.range(4):
            _iteration(s, step=True)
    assert _paths(logs) == [("any-moment", "hook.range()")]
    assert h._loop.range_clock and h._bg_on and h.iteration == 4 and h._loop.confirmed == 4 and not h._steps.in_step
    assert h._loop.step_pattern == {"opt0": 1, "opt1": 1} and h._state_at.range_small[0] == 4


def test_several_optimizers_leave_the_clock_at_an_irregular_iteration(hook_of: Any) -> None:
    s = _state(n_opts=2)
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        for i in h.range(5):
            _iteration(s, step=True)
            if i == 2:  # a second step of one optimizer in iteration 2
                s["model"](torch.randn(6, 4)).square().mean().backward()
                s["opt1"].step()
    assert _paths(logs) == [("any-moment", "hook.range()"), ("boundary", "hook.range()")]
    [line] = [e for e in logs if e["event"] == events.NOTICE_PATH and e["path"] == "boundary"]
    assert "not regular" in line["why"] and "'opt1': 2" in line["why"], line
    assert not h._loop.range_clock and h.iteration == 5


def test_several_optimizers_with_hook_step_stay_any_moment(hook_of: Any) -> None:
    """``hook.step()``: the first iteration runs before the loop declares itself; its steps still count (WGAN's
    n_critic: the first optimizer steps twice per iteration — no "implicit" line for those repeated steps)."""
    s = _state(n_opts=2)
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        assert h.resume() == 0
        got = []
        for _ in range(3):
            s["model"](torch.randn(6, 4)).square().mean().backward()
            s["opt0"].step()
            s["opt0"].zero_grad()
            _iteration(s, step=True)
            got.append(h.step())
    assert got == [1, 2, 3] and h._loop.range_clock and h._bg_on and h._loop.step_pattern == {"opt0": 2, "opt1": 1}
    assert _paths(logs) == [("any-moment", "hook.step()")]


def test_several_optimizers_in_an_implicit_loop_say_why_they_keep_the_boundary_path(hook_of: Any) -> None:
    s = _state(n_opts=2)
    with structlog.testing.capture_logs() as logs:
        h = hook_of(s)
        assert h.resume() == 0
        for _ in range(3):
            _iteration(s, step=True)
    assert _paths(logs) == [("boundary", "implicit")]
    assert "2 optimizers" in [e for e in logs if e["event"] == events.NOTICE_PATH][0]["why"]
    assert not h._bg_on and h.iteration == 3
