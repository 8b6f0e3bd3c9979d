"""accelerate.Accelerator adapter end to end: torchrun, 2 ranks (DDP/gloo, CPU), BatchNorm + dropout."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from ._jobs import preempt_and_resume, read_log, reference_run

STEPS = 30
SCRIPT = "accelerate_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    return reference_run(SCRIPT, tmp_path_factory.mktemp("acc-ref"), STEPS)


def test_usr1_to_one_rank_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 6, "usr1-rank1", marker="random_states_1.pkl")


def test_sigterm_to_rank0_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 13, "term-rank0", marker="optimizer.bin")


def test_sigterm_to_torchrun_reaches_both_ranks(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 19, "term-torchrun", marker="random_states_0.pkl")


ACCUM_STEPS = 6
ACCUM = ("--grad-accum", "8")


@pytest.fixture(scope="module")
def accum_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    return reference_run(SCRIPT, tmp_path_factory.mktemp("acc-accum-ref"), ACCUM_STEPS, ACCUM)


def test_notice_during_accumulation_commits_at_the_next_micro_batch(accum_reference: tuple[dict[int, str], Path],
                                                                     tmp_path: Path) -> None:
    """Issue 23: ``accelerator.accumulate`` over 8 micro-batches of 0.75 s, a notice (SIGUSR1 to rank 1) at the
    first micro-batch of step 2 with a 4 s deadline. Acting at the next real optimizer step commits ~6 s later:
    late (exit 75). Now the next micro-batch's forward saves step 2 (RNG, BatchNorm statistics and Accelerate's
    micro-batch counter as at the step) and the resume replays step 2 from its first micro-batch, bitwise."""
    stop = preempt_and_resume(SCRIPT, tmp_path, accum_reference, ACCUM_STEPS, 2, "usr1-rank1",
                              marker="random_states_1.pkl", extra_args=ACCUM, step_time="0.75",
                              env={"SPOTGUARD_SIGNAL_GRACE": "4"})
    assert stop == 2
    run = read_log(tmp_path / "preempted.log")
    assert not run.events("checkpoint_late"), run.tail()
    assert all(e["late"] is False for e in run.events("exit")), run.events("exit")
