"""A notice while the framework evaluates (issue 14, item 4): Lightning's validation loop, HF Trainer's evaluation.

Real torchrun (2 ranks, DDP/gloo, CPU), a real ``spotguard daemon``, a drill through
it while a long evaluation runs (evaluation batches of 0.5 s, the whole evaluation
much longer than the notice's deadline). What must happen: every rank commits the
checkpoint of the last completed optimizer step (the step the evaluation started
after) and exits 143 before the deadline, without waiting for the evaluation to end;
the restarted job resumes from that step and ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotguard.daemon.client import request_sync
from spotguard.launch import DaemonProc
from spotguard.protocol import DrillCancel

from .._daemons import drill, wait_subscribed
from .._torchrun import TorchRun, first_difference, load_out
from ._jobs import Job, assert_same_losses, committed, losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]

STEPS = 16
EVAL_EVERY = 6  # the first evaluation starts after optimizer step 6
EVAL_BATCHES = 40
EVAL_BATCH_TIME = "0.5"  # 40 x 0.5 s = 20 s of evaluation
DEADLINE = 8.0  # the drill's notice: far shorter than the evaluation


def _job(script: str, log: Path, args: list[str], sock: str | None = None) -> Job:
    return Job(script, log, args, env={"SPOTGUARD_SOCKET": sock} if sock else None)


def _eval_lines(run: TorchRun, key: str) -> list[dict[str, Any]]:
    return [e for e in run.lines() if key in e]


def _reference(script: str, d: Path) -> tuple[dict[int, str], Path]:
    run = _job(script, d / "ref.log", ["--steps", str(STEPS), "--no-hook", "--out", str(d / "ref.pt"),
                                       "--eval-every", str(EVAL_EVERY), "--eval-batches", "2"])
    assert run.wait(180) == 0, run.tail()
    ref = losses(run)
    assert sorted(ref) == list(range(STEPS)), run.tail()
    return ref, d / "ref.pt"


def _preempt_during_eval_and_resume(script: str, key: str, reference: tuple[dict[int, str], Path], tmp: Path,
                                    daemon: DaemonProc) -> None:
    store = tmp / "ckpt"
    run = _job(script, tmp / "preempted.log",
               ["--steps", str(STEPS), "--storage", str(store), "--eval-every", str(EVAL_EVERY),
                "--eval-batches", str(EVAL_BATCHES), "--eval-step-time", EVAL_BATCH_TIME], daemon.socket)
    try:
        wait_subscribed(daemon.socket, {0, 1}, run)
        run.wait_for(lambda: any(e[key] >= 1 for e in _eval_lines(run, key)), 120, "the evaluation under way")
        notice_id = drill(daemon.socket, deadline_in=DEADLINE)
        run.wait(60)
    finally:
        run.kill()
    request_sync(daemon.socket, DrillCancel(id=notice_id))  # the restarted job must not get it replayed

    evals = _eval_lines(run, key)
    assert {e["step"] for e in evals} == {EVAL_EVERY}, evals  # the notice landed in the first evaluation
    assert max(e[key] for e in evals) < EVAL_BATCHES - 1, "the evaluation ran to its end before the exit"
    for name in ("agreed", "checkpoint_committed"):
        got = {e["rank"]: e["step"] for e in run.events(name) if e.get("notice_id") == notice_id}
        assert got == {0: EVAL_EVERY, 1: EVAL_EVERY}, (name, got, run.tail())
    for e in run.events("checkpoint_committed"):
        assert e["seconds_left"] > 0, e
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1}, run.tail()
    for e in exits.values():
        assert e["code"] == 143 and e["committed"] and e["notice_id"] == notice_id, e
        assert e["seconds_left"] > 0, f"exit after the notice's deadline: {e}"
    assert committed(store) == [EVAL_EVERY]

    resumed = _job(script, tmp / "resumed.log", ["--steps", str(STEPS), "--storage", str(store),
                                                 "--out", str(tmp / "resumed.pt"), "--eval-every", str(EVAL_EVERY),
                                                 "--eval-batches", "2"])
    assert resumed.wait(180) == 0, resumed.tail()
    assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {0: EVAL_EVERY, 1: EVAL_EVERY}
    ref, ref_out = reference
    assert_same_losses(ref, losses(resumed), EVAL_EVERY, STEPS)
    diff = first_difference(load_out(ref_out)["model"], load_out(tmp / "resumed.pt")["model"])
    assert diff is None, f"final weights differ at {diff}"


@pytest.fixture(scope="module")
def pl_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    pytest.importorskip("lightning")
    return _reference("lightning_train.py", tmp_path_factory.mktemp("pl-eval-ref"))


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    pytest.importorskip("transformers")
    return _reference("hf_trainer_train.py", tmp_path_factory.mktemp("hf-eval-ref"))


def test_lightning_notice_during_validation_commits_last_step_and_exits_in_time(
        pl_reference: tuple[dict[int, str], Path], tmp_path: Path, daemon: DaemonProc) -> None:
    """On Lightning's any-moment path (no accumulation): the round during validation hands its notice over and
    the validation's next batch acts on it (it waited for the whole validation and the next step before)."""
    _preempt_during_eval_and_resume("lightning_train.py", "val_batch", pl_reference, tmp_path, daemon)


def test_hf_trainer_notice_during_evaluation_commits_last_step_and_exits_in_time(
        hf_reference: tuple[dict[int, str], Path], tmp_path: Path, daemon: DaemonProc) -> None:
    _preempt_during_eval_and_resume("hf_trainer_train.py", "eval_batch", hf_reference, tmp_path, daemon)
