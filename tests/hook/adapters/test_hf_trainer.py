"""transformers.Trainer adapter end to end: torchrun, 2 ranks (DDP/gloo, CPU), tiny GPT-2 from a config."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ._jobs import preempt_and_resume, preempt_in_accumulation, reference_run

STEPS = 30  # 12 steps an epoch: the run crosses two epoch ends
SCRIPT = "hf_trainer_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    return reference_run(SCRIPT, tmp_path_factory.mktemp("hf-ref"), STEPS)


@pytest.mark.long(reason="sibling in make test: test_save_only_model_still_gets_a_full_checkpoint (the same SIGUSR1 to "
                         "rank 1 at step 8: both ranks save at one step, resume_from_checkpoint=hook.latest(), "
                         "bitwise) and test_sigterm_to_one_rank_with_jit_checkpoint_enabled")
def test_usr1_to_one_rank_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """The notice reaches rank 1 only; both ranks save at one step; resume_from_checkpoint=hook.latest()."""
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 8, "usr1-rank1", marker="trainer_state.json")


def test_sigterm_to_one_rank_with_jit_checkpoint_enabled(reference: tuple[dict[int, str], Path],
                                                         tmp_path: Path) -> None:
    """enable_jit_checkpoint=True would checkpoint on the signalled rank only; spotguard switches it off."""
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 14, "term-rank1", marker="rng_state_1.pth",
                       extra_args=("--jit",))
    assert "enable_jit_checkpoint switched off" in (tmp_path / "preempted.log").read_text()


def test_save_only_model_still_gets_a_full_checkpoint(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """``save_only_model=True``: the Trainer's saves hold the weights only; spotguard's checkpoint must still hold
    optimizer, scheduler and RNG (before: weights only, committed and exit 143 'nothing lost', and the resumed
    run restarted its optimizer: not bitwise)."""
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 8, "usr1-rank1", marker="optimizer.pt",
                       extra_args=("--save-only-model",))


@pytest.mark.long(reason="sibling in make test: tests/hook/test_torchrun.py::test_sigterm_to_torchrun_without_daemon "
                         "(torchrun forwards SIGTERM to every rank, both agree one step, commit, resume exact) and "
                         "this file's test_sigterm_to_one_rank_with_jit_checkpoint_enabled (this adapter's save and "
                         "resume after a signal)")
def test_sigterm_to_torchrun_reaches_both_ranks(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 20, "term-torchrun", marker="optimizer.pt")


def test_notice_during_accumulation_commits_at_the_next_micro_batch(tmp_path: Path) -> None:
    """Issue 23: the Trainer writes checkpoint-2 at the next micro-batch (``on_substep_end``), its RNG as at the
    epoch's start (where the resumed Trainer loads it); the old ``on_step_end`` committed 10 s after the notice."""
    preempt_in_accumulation(SCRIPT, tmp_path, "rng_state_1.pth")
