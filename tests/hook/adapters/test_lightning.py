"""Lightning adapter end to end: torchrun, 2 ranks (DDP/gloo, CPU), notice mid-epoch, commit, resume bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

from ._jobs import preempt_and_resume, reference_run

STEPS = 30  # 12 batches an epoch: the run crosses two epoch ends
SCRIPT = "lightning_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    return reference_run(SCRIPT, tmp_path_factory.mktemp("pl-ref"), STEPS)


def _lightning_sigterm_path_never_ran(tmp: Path) -> None:
    # Lightning's own SIGTERM path (handler broadcast + SIGTERMException) never ran: spotguard owned the signal.
    assert "SIGTERMException" not in (tmp / "preempted.log").read_text()


@pytest.mark.long(reason="sibling in make test: test_sigterm_to_one_rank_beats_lightnings_handler (a notice to one "
                         "rank: both stop at one step, lightning.ckpt committed, resume bitwise) and "
                         "test_elastic_frameworks.py::test_lightning_resumes_on_another_world_size (SIGUSR1 to one "
                         "rank, automatic resume through trainer.ckpt_path)")
def test_usr1_to_one_rank_resumes_bitwise(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """The notice reaches rank 1 only; both ranks stop at one step; automatic resume (trainer.ckpt_path)."""
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 7, "usr1-rank1", marker="lightning.ckpt")


def test_sigterm_to_one_rank_beats_lightnings_handler(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """SIGTERM to rank 0 only: Lightning's handler would broadcast inside the handler and stop that rank alone;
    spotguard's agreement stops both at one step. Resume via ``fit(ckpt_path=hook.latest())``."""
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 14, "term-rank0", marker="lightning.ckpt",
                       resume_args=("--explicit-ckpt-path",))
    _lightning_sigterm_path_never_ran(tmp_path)


@pytest.mark.long(reason="sibling in make test: tests/hook/test_torchrun.py::test_sigterm_to_torchrun_without_daemon "
                         "(torchrun forwards SIGTERM to every rank, both agree one step, commit, resume exact) and "
                         "this file's test_sigterm_to_one_rank_beats_lightnings_handler (this adapter's save and "
                         "resume after a SIGTERM; Lightning's own SIGTERM handler never runs)")
def test_sigterm_to_torchrun_reaches_both_ranks(reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 20, "term-torchrun", marker="lightning.ckpt")
    _lightning_sigterm_path_never_ran(tmp_path)
