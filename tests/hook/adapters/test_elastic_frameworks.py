"""Lightning, HF Trainer and Accelerate on another world size (2 -> 1 and 1 -> 2 ranks): the committed checkpoint resumes at its step and
the run finishes its steps; Lightning's per-rank RNG follows the elastic rule (own, or derived for a new rank).
See docs/frameworks.md, "Elastic resume"."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from ._jobs import Job, assert_agreed_exit, committed, load_out, losses

STEPS = 16

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def preempt_then_resume(script: str, tmp: Path, before: int, after: int) -> tuple[int, Job]:
    """Preempt a ``before``-rank run mid-epoch (SIGUSR1 to its last rank), resume on ``after`` ranks to the end."""
    store = tmp / "ckpt"
    run = Job(script, tmp / "preempted.log", ["--steps", str(STEPS), "--step-time", "0.05", "--storage", str(store)],
              nproc=before)
    try:
        run.wait_step(5, 120)
        run.signal_rank(before - 1, signal.SIGUSR1)
        assert run.wait(90) != 0
    finally:
        run.kill()
    stop = assert_agreed_exit(run, ranks=tuple(range(before)))
    assert committed(store) == [stop] and 5 <= stop < STEPS

    resumed = Job(script, tmp / "resumed.log", ["--steps", str(STEPS), "--storage", str(store),
                                                "--out", str(tmp / "resumed.pt")], nproc=after)
    assert resumed.wait(150) == 0, resumed.tail()
    assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {r: stop for r in range(after)}
    steps = sorted(losses(resumed))
    assert steps and steps[0] >= stop and steps[-1] == STEPS - 1, steps  # nothing before the checkpoint redone
    assert load_out(tmp / "resumed.pt")["steps"] == STEPS
    return stop, resumed


def needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} not installed")


@needs("lightning")
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_lightning_resumes_on_another_world_size(tmp_path: Path, before: int, after: int) -> None:
    stop, resumed = preempt_then_resume("lightning_train.py", tmp_path, before, after)
    assert sorted(losses(resumed)) == list(range(stop, STEPS))
    elastic = {e["rank"]: e for e in resumed.events("elastic_resume")}
    assert sorted(elastic) == list(range(after)), resumed.tail()
    assert all(e["old_world_size"] == before and e["world_size"] == after for e in elastic.values())
    assert [elastic[r]["rng"] for r in range(after)] == ["own" if r < before else "derived" for r in range(after)]


@needs("transformers")
@pytest.mark.parametrize("before,after", [
    pytest.param(2, 1, marks=pytest.mark.long(
        reason="sibling in make test: [1-2] (this adapter's checkpoint resumed on another world size) and "
               "test_lightning_resumes_on_another_world_size[2-1] (2 -> 1 through the same elastic resume)")),
    (1, 2)])
def test_hf_trainer_resumes_on_another_world_size(tmp_path: Path, before: int, after: int) -> None:
    preempt_then_resume("hf_trainer_train.py", tmp_path, before, after)


@needs("accelerate")
@pytest.mark.parametrize("before,after", [
    pytest.param(2, 1, marks=pytest.mark.long(
        reason="sibling in make test: [1-2] (this adapter's checkpoint resumed on another world size) and "
               "test_lightning_resumes_on_another_world_size[2-1] (2 -> 1 through the same elastic resume)")),
    (1, 2)])
def test_accelerate_resumes_on_another_world_size(tmp_path: Path, before: int, after: int) -> None:
    stop, resumed = preempt_then_resume("accelerate_train.py", tmp_path, before, after)
    assert sorted(losses(resumed)) == list(range(stop, STEPS))
