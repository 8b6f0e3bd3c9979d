"""accelerate.Accelerator adapter end to end: torchrun, 2 ranks (DDP/gloo, CPU), BatchNorm + dropout."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from ._jobs import (Reference, first_difference, load_out, preempt_and_resume, preempt_in_accumulation, read_log,
                    reference_run)

STEPS = 30
SCRIPT = "accelerate_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    return reference_run(SCRIPT, tmp_path_factory.mktemp("acc-ref"), STEPS)


@pytest.mark.long(reason="sibling in make test: test_sigterm_to_rank0_resumes_bitwise (a notice to one rank: both "
                         "save at one step, resume bitwise) and test_notice_during_accumulation_commits_at_the_next_"
                         "micro_batch (SIGUSR1 to rank 1, random_states_1.pkl saved, resume bitwise)")
def test_usr1_to_one_rank_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 6, "usr1-rank1", marker="random_states_1.pkl")


def test_sigterm_to_rank0_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 13, "term-rank0", marker="optimizer.bin")


@pytest.mark.long(reason="sibling in make test: tests/hook/test_torchrun.py::test_sigterm_to_torchrun_without_daemon "
                         "(torchrun forwards SIGTERM to every rank, both agree one step, commit, resume exact) and "
                         "this file's test_sigterm_to_rank0_resumes_bitwise (this adapter's save and resume after a "
                         "signal)")
def test_sigterm_to_torchrun_reaches_both_ranks(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 19, "term-torchrun", marker="random_states_0.pkl")


def test_notice_during_accumulation_commits_at_the_next_micro_batch(tmp_path: Path) -> None:
    """Issue 23: ``accelerator.accumulate`` on the boundary path (here: ``SPOTGUARD_BACKGROUND_AGREEMENT=0``; any
    configuration the any-moment writer refuses); the next micro-batch's forward saves step 2 (RNG, BatchNorm
    statistics and ``accelerator.step`` as at the step); the old next-real-step path committed 11 s after the
    notice. The any-moment path with accumulation: test_accelerate_anymoment.py."""
    preempt_in_accumulation(SCRIPT, tmp_path, "random_states_1.pkl", env={"SPOTGUARD_BACKGROUND_AGREEMENT": "0"})
    paths = read_log(tmp_path / "preempted.log").events("notice_path")
    assert len(paths) == 2 and all(e["path"] == "boundary" for e in paths), paths


@pytest.mark.long(reason="sibling in make test: test_accelerate_anymoment.py::test_notice_mid_micro_batch_with_"
                         "accumulation_commits_s_and_resumes_bitwise[ddp] (the same files; its [broadcast-buffers-off] "
                         "case is this one on the any-moment path)")
def test_boundary_save_keeps_each_ranks_own_buffers(tmp_path: Path) -> None:
    """DDP with ``broadcast_buffers=False``: ``save_state`` writes rank 0's model only, so rank 1 resumed with rank
    0's BatchNorm statistics; each rank's own are written beside it (``spotguard_buffers_<rank>.pt``) and loaded
    after ``load_state``: rank 1's final buffers are bitwise the uninterrupted run's."""
    args = ("--no-broadcast-buffers",)
    reference = Reference(SCRIPT, tmp_path, 10, args)
    try:
        preempt_and_resume(SCRIPT, tmp_path, reference, 10, 4, "usr1-rank1", marker="spotguard_buffers_1.pt",
                           extra_args=args, env={"SPOTGUARD_BACKGROUND_AGREEMENT": "0"})
    finally:
        reference.run.kill()
    diff = first_difference(load_out(tmp_path / "ref.pt.rank1"), load_out(tmp_path / "resumed.pt.rank1"))
    assert diff is None, f"rank 1's final buffers differ at {diff}"
