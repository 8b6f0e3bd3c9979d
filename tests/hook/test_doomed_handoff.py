"""The commit lands after the doomed node left (issue 26, ``spotguard/hook/handoff.py``), real ``torchrun``.

FSDP2 over 2 ranks (gloo, CPU), a notice to rank 1 only with a short deadline, rank 1 evacuating its shards to
rank 0, and a store whose data-file uploads are slow (``_models_train.py --slow-upload``): rank 0's uploads
outlast rank 1's deadline. Rank 1 is safe on rank 0's acknowledgement, hands the save over and leaves by its
deadline; rank 0 uploads, commits on its own bound after that deadline, and the resume is bitwise against the
job's own uninterrupted reference loop. Before the handoff every save collective included rank 1 and rank 0's
uploads were bounded by rank 1's deadline: nothing was committed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from spotguard.hook.elastic import rank_key
from spotguard.storage.commit import COMMIT_NAME, step_dir

from ._torchrun import TorchRun
from .test_doomed import MODEL_STEPS, MODELS, assert_models_resume_bitwise, files_by_item, record
from .test_torchrun import committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NOTICE_S = 4.0  # rank 1's deadline, from the notice
UPLOAD_S = 3.0  # each data file's upload: rank 0 uploads two (its own, rank 1's) -> ~6 s > NOTICE_S


def _at(line: dict) -> datetime:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))


@pytest.mark.serial
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


FROZEN_MIB = 64  # a large-ish replicated state: the survivor's write of it takes a while


@pytest.mark.parametrize("doomed", [
    pytest.param(1, marks=pytest.mark.long(
        reason="sibling in make test: [0] (the same DDP hand-over before the survivor's write; rank 0 doomed, "
               "the survivor DCP's coordinator) and test_doomed.py::"
               "test_notice_to_one_rank_the_doomed_rank_writes_only_its_own_state (rank 1 doomed under DDP "
               "writes only its per-rank state, safe, the commit reaches it, resume bitwise)")),
    0])
def test_ddp_doomed_rank_is_safe_and_hands_over_before_the_survivor_writes(tmp_path: Path, doomed: int) -> None:
    """DDP (nothing sharded: every item but the per-rank state is replicated), a notice to one rank: the doomed
    rank takes no part in ``dcp.save``. It writes its per-rank state, is safe and hands the save over before the
    survivor's part of ``dcp.save`` even starts (the survivor's store holds its local plan until that handover
    — while the doomed rank was in DCP's collectives it handed over only after the survivor's write). The
    survivor's files keep its rank's name and its ``.metadata`` lists the doomed rank's state (rank 0 doomed:
    DCP's coordinator is the survivor); the record's writers give the doomed rank its own bytes only; the
    commit reaches the doomed rank; the resume is bitwise."""
    store = tmp_path / "ckpt"
    args = ["--variant", "ddp", "--storage", str(store), "--steps", str(MODEL_STEPS), "--frozen-mib", str(FROZEN_MIB)]
    pre = TorchRun(tmp_path / "pre.log", [*args, "--phase", "pre", "--notify-at", "4", "--notify-rank", str(doomed),
                                          "--survivor-waits"], script=MODELS)
    assert pre.wait(120) != 0, pre.tail()
    [stop] = committed(store)
    [waited] = [e for e in pre.lines() if "survivor_write" in e]
    assert waited["survivor_write"] == 1 - doomed and waited["handover_before_write"] is True, (waited, pre.tail(60))
    [safe] = pre.events("checkpoint_safe", doomed)
    [handed] = pre.events("checkpoint_handed_over", doomed)
    assert _at(safe) <= _at(handed), (safe, handed)
    folder = store / step_dir(stop)
    own = (folder / f"__{doomed}_0.distcp").stat().st_size
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    by_item = files_by_item(store, stop)
    assert {k for k, f in by_item.items() if f.startswith(f"__{doomed}_")} == {rank_key(doomed)}, by_item
    assert by_item[rank_key(1 - doomed)].startswith(f"__{1 - doomed}_") and len(by_item) > 2, by_item
    writers = record(store, stop).extra["writers"]
    assert writers["plan"] == "survivors" and writers["doomed"] == [doomed], writers
    assert writers["bytes_per_rank"][doomed] == own == safe["bytes"] < 1 << 20, (writers, own, safe)
    assert writers["bytes_per_rank"][1 - doomed] > FROZEN_MIB << 20, writers
    assert "evacuated" not in writers and "evacuated_to" not in safe, (writers, safe)
    [done] = pre.events("checkpoint_committed", doomed)  # the survivors' word reached it
    assert done["step"] == stop and _at(handed) <= _at(done), done
    shown = subprocess.run([sys.executable, "-m", "spotguard", "checkpoints", str(store)], capture_output=True,
                           text=True, timeout=60)
    [row] = [ln for ln in shown.stdout.splitlines() if ln.split()[:1] == [str(stop)]]
    assert f"notice on rank {doomed}: wrote " in row and "evacuated" not in row, row
    assert_models_resume_bitwise(tmp_path, args, pre, stop)


def test_ddp_survivor_lost_after_the_doomed_rank_left_commits_nothing(tmp_path: Path) -> None:
    """The same DDP save, the survivor killed after the doomed rank wrote its per-rank state and handed over,
    with the survivor's own files and ``.metadata`` written but no commit yet (a test delay before it):
    nothing is committed, and the doomed rank leaves without claiming a commit."""
    store = tmp_path / "ckpt"
    run = TorchRun(tmp_path / "pre.log", ["--variant", "ddp", "--storage", str(store), "--steps", str(MODEL_STEPS),
                                          "--phase", "pre", "--notify-at", "4", "--notify-rank", "1"],
                   script=MODELS, env={"SPOTGUARD_TEST_SAVE_DELAY": "30", "SPOTGUARD_TEST_SAVE_DELAY_RANK": "0"})
    try:
        run.wait_for(lambda: bool(run.events("checkpoint_started", 0)) and bool(run.events("checkpoint_handed_over", 1))
                     and (store / step_dir(run.events("checkpoint_started", 0)[0]["step"]) / ".metadata").exists(),
                     90, "the doomed rank handed over, the survivor's .metadata written")
        os.kill(run.pid(0), signal.SIGKILL)
        run.wait(60)
    finally:
        run.kill()
    step = run.events("checkpoint_started", 0)[0]["step"]
    assert committed(store) == [] and not (store / step_dir(step) / COMMIT_NAME).exists(), run.tail(60)
    assert not run.events("checkpoint_committed"), run.tail(60)
    [safe] = run.events("checkpoint_safe", 1)
    assert 0 < safe["bytes"] < 1 << 20 and "evacuated_to" not in safe, safe  # its own per-rank state only
    [left] = run.events("exit", 1)
    assert left["committed"] is False and _at(safe) <= _at(left), left
