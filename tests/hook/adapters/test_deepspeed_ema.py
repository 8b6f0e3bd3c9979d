"""DeepSpeed: ``add_state`` objects the loop changes after ``engine.step()`` (issue 29's review, oracle pattern
``deepspeed_zero2_ema``): an EMA updated right after the step and a meter updated before it.

A notice lands while the loop sleeps after its EMA update (between step S and the next forward). The checkpoint of
S must hold the EMA with update S and the meter as at the next iteration's first forward; before the fix the
adapter copied them at the end of ``engine.step()`` (the EMA one update behind, so the resumed run never applied
update S). Both ways of acting: the any-moment path and the boundary path (``SPOTGUARD_BACKGROUND_AGREEMENT=0``).
Real deepspeed, torchrun, 2 ranks, gloo, CPU; the comm op prebuilt (test_deepspeed.py's ``ds_env``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")

from ._jobs import Reference, preempt_and_resume, read_log  # noqa: E402
from .test_deepspeed import ds_env  # noqa: E402, F401 - the CPU accelerator and the prebuilt comm op

SCRIPT = "../tests/hook/adapters/deepspeed_ema_train.py"  # Job runs examples/<script>
STEPS = 8

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("path", ["any-moment", "boundary"])
def test_ema_updated_after_engine_step_is_saved_with_its_update_and_resumes_bitwise(tmp_path: Path,
                                                                                     path: str) -> None:
    env = {"SPOTGUARD_BACKGROUND_AGREEMENT": "0"} if path == "boundary" else {}
    ref = Reference(SCRIPT, tmp_path, STEPS)
    try:
        stop = preempt_and_resume(SCRIPT, tmp_path, ref, STEPS, 2, "usr1-rank1", marker="spotguard_rank1.pt",
                                  step_time="0.6", env=env)  # final weights, EMA and meter compared bitwise
    finally:
        ref.run.kill()
    run = read_log(tmp_path / "preempted.log")
    assert {e["rank"]: e["path"] for e in run.events("notice_path")} == {0: path, 1: path}, run.tail()
    assert stop >= 3, stop
