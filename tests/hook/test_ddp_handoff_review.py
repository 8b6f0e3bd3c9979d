"""Review of the DDP handoff (issue 26, ``handoff.Handoff.replicated_only``): ways real jobs and operators
break the doomed ranks' stay out of ``dcp.save``, real ``torchrun`` (gloo, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.storage.commit import step_dir

from ._torchrun import TorchRun
from .test_doomed import MODEL_STEPS, MODELS, record
from .test_torchrun import committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_survivors_plan_off_on_the_doomed_node_only_still_commits(tmp_path: Path) -> None:
    """``SPOTGUARD_SURVIVORS_PLAN=0`` on the doomed node only (the knob is read per process; a node rolled out with
    another environment): the save must still commit. Before the fix the rank with the knob off skipped
    ``replicated_only``'s all-reduce and met it with ``dcp.save``'s gather: the save timed out and nothing was
    committed (it committed before the DDP handoff, 55c4734)."""
    store = tmp_path / "ckpt"
    args = ["--variant", "ddp", "--storage", str(store), "--steps", str(MODEL_STEPS)]
    pre = TorchRun(tmp_path / "pre.log", [*args, "--phase", "pre", "--notify-at", "4", "--notify-rank", "1",
                                          "--notice-seconds", "15",
                                          "--rank-env", "1:SPOTGUARD_SURVIVORS_PLAN=0"], script=MODELS)
    assert pre.wait(60) != 0, pre.tail()
    assert len(committed(store)) == 1, pre.tail(40)
    [stop] = committed(store)
    assert record(store, stop).extra["writers"]["doomed"] == [1]
    assert (store / step_dir(stop) / ".metadata").exists()
