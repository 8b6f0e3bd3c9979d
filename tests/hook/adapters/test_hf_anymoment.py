"""HF Trainer's any-moment path (issue 23, ``hf_anymoment.py``): torchrun, 2 ranks (DDP/gloo, CPU), tiny GPT-2.

A notice in the middle of a 4 s training step with a 3 s deadline: the boundary path acts at a step end (the step in
flight and the next: committed ~8 s later, late); the background path commits the last completed step S within a
fraction of a second, in the Trainer's own ``checkpoint-N`` files, equal to the Trainer's own save of S in an
uninterrupted run, and the resumed run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from ._jobs import Job, assert_agreed_exit, committed, read_log, resume_and_compare  # noqa: E402

SCRIPT = "hf_trainer_train.py"
STEPS = 5
AT = 2  # the notice comes in the middle of step 3 (global_step 2 -> 3): S = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two loaded checkpoint objects differ (tensors and arrays bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # numpy arrays (the numpy RNG state)
        return [] if a.tobytes() == b.tobytes() and a.dtype == b.dtype else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _trainer_state(path: Path) -> dict[str, Any]:
    st = json.loads(path.read_text())
    st.pop("save_steps")  # the reference run saves every AT steps; the preempted one has no save_steps of its own
    st["stateful_callbacks"]["TrainerControl"]["args"].pop("should_save")  # set while the Trainer's own save runs
    return st


def assert_checkpoint_equals_trainers(ours: Path, theirs: Path) -> None:
    """spotguard's files of step S equal the Trainer's own ``checkpoint-S`` of an uninterrupted run."""
    from safetensors.torch import load_file

    assert sorted(p.name for p in theirs.iterdir()) == sorted(p.name for p in ours.iterdir() if p.name != "COMMIT.json")
    diffs = _same(load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors")), "model")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        diffs += _same(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False),
                       name)
    diffs += _same(_trainer_state(ours / "trainer_state.json"), _trainer_state(theirs / "trainer_state.json"),
                   "trainer_state")
    assert not diffs, diffs[:10]


def test_notice_mid_step_commits_step_s_from_the_background(tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 (3 s deadline) 0-1 s into a 4 s step: committed for S within 1.5 s (the boundary path:
    after the next step end or later, past the deadline), files equal to the Trainer's own save of S, resumed
    bitwise."""
    ref_dir = tmp_path / "ref-out"
    reference = Job(SCRIPT, tmp_path / "ref.log", ["--steps", str(STEPS), "--no-hook", "--out", str(tmp_path / "ref.pt"),
                                                  "--save-steps", str(AT), "--output-dir", str(ref_dir)])
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(STEPS), "--step-time", "4", "--storage", str(store)],
              env={"SPOTGUARD_SIGNAL_GRACE": "3"})
    try:
        run.wait_step(AT, 90)
        run.signal_rank(1, signal.SIGUSR1)
        assert run.wait(60) != 0
        assert reference.wait(120) == 0, reference.tail()
    finally:
        run.kill()
        reference.kill()
    assert any(e["path"] == "any-moment" for e in run.events("notice_path")), run.tail()
    stop = assert_agreed_exit(run)
    assert stop == AT and committed(store) == [AT], run.tail()
    done = run.events("checkpoint_committed")
    assert done and all(e["late"] is False and e["seconds_since_notice"] < 1.5 for e in done), done
    assert not run.events("checkpoint_late"), run.tail()
    assert_checkpoint_equals_trainers(store / f"step-{AT:08d}", ref_dir / f"checkpoint-{AT}")
    ref = {int(e["step"]): e["hex"] for e in read_log(tmp_path / "ref.log").lines() if "hex" in e}
    resume_and_compare(SCRIPT, tmp_path, (ref, tmp_path / "ref.pt"), STEPS, AT)


def test_evaluation_keeps_the_boundary_path_and_says_so(tmp_path: Path) -> None:
    """eval_strategy="steps" is not proven for the background writer: the ``notice_path`` line says boundary and
    why, on every rank, and no any-moment line is logged."""
    run = Job(SCRIPT, tmp_path / "eval.log", ["--steps", "2", "--eval-batches", "1", "--eval-every", "1",
                                              "--storage", str(tmp_path / "ckpt")])
    try:
        assert run.wait(90) == 0, run.tail()
    finally:
        run.kill()
    paths = run.events("notice_path")
    assert {e["rank"] for e in paths} == {0, 1}, run.tail()
    assert all(e["path"] == "boundary" and "eval_strategy='steps'" in e["why"] and "on_step_end" in e["why"]
               for e in paths), paths
