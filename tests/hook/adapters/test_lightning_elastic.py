"""Lightning on another world size (2 -> 1 and 1 -> 2 ranks): the committed checkpoint resumes at its step,
rank 0 keeps its own RNG streams, a new rank gets derived ones, and the run finishes its steps."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from ._jobs import Job, assert_agreed_exit, committed, load_out, losses

STEPS, SCRIPT = 16, "lightning_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_lightning_resumes_on_another_world_size(tmp_path: Path, before: int, after: int) -> None:
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(STEPS), "--step-time", "0.05",
                                                   "--storage", str(store)], nproc=before)
    try:
        run.wait_step(5, 90)
        run.signal_rank(before - 1, signal.SIGUSR1)
        assert run.wait(90) != 0
    finally:
        run.kill()
    stop = assert_agreed_exit(run, ranks=tuple(range(before)))
    assert committed(store) == [stop] and 5 <= stop < STEPS

    out = tmp_path / "resumed.pt"
    resumed = Job(SCRIPT, tmp_path / "resumed.log", ["--steps", str(STEPS), "--storage", str(store),
                                                     "--out", str(out)], nproc=after)
    assert resumed.wait(120) == 0, resumed.tail()
    assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {r: stop for r in range(after)}
    elastic = {e["rank"]: e for e in resumed.events("elastic_resume")}
    assert sorted(elastic) == list(range(after)), resumed.tail()
    assert all(e["old_world_size"] == before and e["world_size"] == after for e in elastic.values())
    assert [elastic[r]["rng"] for r in range(after)] == ["own" if r < before else "derived" for r in range(after)]
    assert sorted(losses(resumed)) == list(range(stop, STEPS))  # continues at the committed step, nothing redone
    assert load_out(out)["steps"] == STEPS
