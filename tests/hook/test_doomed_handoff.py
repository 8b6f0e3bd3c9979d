"""The commit lands after the doomed node left (issue 26, ``spotguard/hook/handoff.py``), real ``torchrun``.

FSDP2 over 2 ranks (gloo, CPU), a notice to rank 1 only with a short deadline, rank 1 evacuating its shards to
rank 0, and a store whose data-file uploads are slow (``_models_train.py --slow-upload``): rank 0's uploads
outlast rank 1's deadline. Rank 1 is safe on rank 0's acknowledgement, hands the save over and leaves by its
deadline; rank 0 uploads, commits on its own bound after that deadline, and the resume is bitwise against the
job's own uninterrupted reference loop. Before the handoff every save collective included rank 1 and rank 0's
uploads were bounded by rank 1's deadline: nothing was committed.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from spotguard.storage.commit import step_dir

from ._torchrun import TorchRun
from .test_doomed import MODEL_STEPS, MODELS, assert_models_resume_bitwise, record
from .test_torchrun import committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NOTICE_S = 4.0  # rank 1's deadline, from the notice
UPLOAD_S = 3.0  # each data file's upload: rank 0 uploads two (its own, rank 1's) -> ~6 s > NOTICE_S


def _at(line: dict) -> datetime:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))


def test_commit_lands_after_the_doomed_rank_left(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    args = ["--variant", "fsdp2", "--storage", str(store), "--steps", str(MODEL_STEPS)]
    pre = TorchRun(tmp_path / "pre.log", [*args, "--phase", "pre", "--notify-at", "4", "--notify-rank", "1",
                                          "--notice-seconds", str(NOTICE_S), "--slow-upload", str(UPLOAD_S)],
                   script=MODELS, env={"SPOTGUARD_EVACUATE": "always"})
    assert pre.wait(90) != 0, pre.tail()
    assert len(committed(store)) == 1, pre.tail(80)
    [stop] = committed(store)
    [seen] = pre.events("notice_seen", 1)
    deadline = datetime.fromisoformat(seen["deadline"].replace("Z", "+00:00"))
    [safe] = pre.events("checkpoint_safe", 1)
    [handed] = pre.events("checkpoint_handed_over", 1)
    [left] = pre.events("exit", 1)
    assert safe["evacuated_to"] == 0 and safe["bytes"] == 0, safe
    assert _at(safe) <= _at(handed) <= _at(left) <= deadline, (safe, handed, left, deadline)
    assert left["committed"] is False and left["code"] == 75, left  # it left before the commit, by its deadline
    [done] = pre.events("checkpoint_committed", 0)
    assert _at(done) > deadline and done["late"] is False, (done, deadline)  # on the survivors' own bound
    writers = record(store, stop).extra["writers"]
    shard = (store / step_dir(stop) / "__1_0.distcp").stat().st_size
    assert writers["doomed"] == [1] and writers["evacuated"] == {"1": {"to": 0, "bytes": shard}}, writers
    assert writers["bytes_per_rank"][1] == 0, writers  # rank 1 wrote nothing itself (rank 0 wrote .metadata)
    assert_models_resume_bitwise(tmp_path, args, pre, stop)
