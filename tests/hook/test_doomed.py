"""Notice-aware save planning with real ``torchrun`` (2 ranks, gloo, CPU): a notice to one rank only.

The doomed rank (its own SIGUSR1: a notice on its "node") writes only its per-rank
state; the survivor writes every replicated (DDP) item. Asserted from the bytes on
storage (DCP's ``.metadata`` says which file holds each item), the commit record's
``writers`` and the log lines; the resume is bitwise. The survivor's loss before the
commit leaves the previous checkpoint newest with nothing partial committed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotguard.hook.elastic import rank_key
from spotguard.storage import open_storage
from spotguard.storage.commit import COMMIT_NAME, scan, step_dir
from spotguard.storage.safeload import load_dcp_metadata

from ._torchrun import TorchRun, reference_run
from .test_torchrun import STEPS, assert_agreed_exit, committed, preempt, resume_to_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODELS = Path(__file__).resolve().parent / "_models_train.py"  # its fsdp2 variant, with its own reference loop
MODEL_STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def files_by_item(store: Path, step: int) -> dict[str, str]:
    """Item FQN -> the ``.distcp`` file that holds it, from the checkpoint's DCP metadata."""
    folder = store / step_dir(step)
    md = load_dcp_metadata((folder / ".metadata").read_bytes(), str(folder))
    return {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}


def record(store: Path, step: int) -> Any:
    [info] = [c for c in scan(open_storage(str(store))) if c.step == step and c.committed]
    return info.record


def test_notice_to_one_rank_the_doomed_rank_writes_only_its_own_state(reference: Path, tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    run = preempt(tmp_path, store, "doomed", 6, 1, signal.SIGUSR1)
    assert run.wait() == 1, run.tail()
    stop = assert_agreed_exit(run)
    by_item = files_by_item(store, stop)
    doomed_files = {f for f in by_item.values() if f.startswith("__1_")}
    assert {k for k, f in by_item.items() if f in doomed_files} == {rank_key(1)}, by_item
    assert by_item[rank_key(0)].startswith("__0_")
    rec = record(store, stop)
    writers = rec.extra["writers"]
    assert writers["plan"] == "survivors" and writers["doomed"] == [1], writers
    on_disk = [sum(p.stat().st_size for p in (store / step_dir(stop)).glob(f"__{r}_*.distcp")) for r in (0, 1)]
    assert writers["bytes_per_rank"][1] == on_disk[1] and writers["bytes_per_rank"][0] >= on_disk[0], \
        (writers, on_disk)
    assert on_disk[0] > on_disk[1], on_disk  # the whole model and optimizer went to the survivor
    safe = run.events("checkpoint_safe")
    assert [e["rank"] for e in safe] == [1], safe  # only the doomed rank reports "safe", then waits
    assert safe[0]["bytes"] == on_disk[1] and writers["safe_seconds"]["1"] == safe[0]["seconds"]
    commit_line = run.events("checkpoint_committed", 1)[0]
    assert commit_line["writers"]["doomed"] == [1]
    assert safe[0]["timestamp"] <= commit_line["timestamp"]  # it did not leave before the commit
    shown = subprocess.run([sys.executable, "-m", "spotguard", "checkpoints", str(store)], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    [row] = [ln for ln in shown.stdout.splitlines() if ln.split()[:1] == [str(stop)]]
    assert "notice on rank 1: wrote " in row and "s into the save" in row, row
    resume_to_end(tmp_path, store, "resumed", stop, reference)


def items_by_file(store: Path, step: int) -> dict[str, int]:
    """``.distcp`` file -> how many DCP items (shards, blobs) it holds."""
    folder = store / step_dir(step)
    md = load_dcp_metadata((folder / ".metadata").read_bytes(), str(folder))
    out: dict[str, int] = {}
    for info in md.storage_data.values():
        out[info.relative_path] = out.get(info.relative_path, 0) + 1
    return out


def test_fsdp2_doomed_rank_evacuates_its_shards_to_the_survivor(tmp_path: Path) -> None:
    """FSDP2 (its shards are unique), a notice to rank 1 only, ``SPOTGUARD_EVACUATE=always``: rank 1 streams
    its data file to rank 0's memory and is safe on rank 0's acknowledgement having written nothing to storage;
    rank 0 uploads it under rank 1's own file name (DCP's metadata unchanged); the commit names who wrote what,
    the CLI shows it and the resume is bitwise against the job's own uninterrupted reference loop."""
    store = tmp_path / "ckpt"
    args = ["--variant", "fsdp2", "--storage", str(store), "--steps", str(MODEL_STEPS)]
    pre = TorchRun(tmp_path / "pre.log", [*args, "--phase", "pre", "--notify-at", "4", "--notify-rank", "1"],
                   script=MODELS, env={"SPOTGUARD_EVACUATE": "always"})
    assert pre.wait(180) != 0, pre.tail()
    [stop] = committed(store)
    writers = record(store, stop).extra["writers"]
    shard = (store / step_dir(stop) / "__1_0.distcp").stat().st_size
    assert writers["doomed"] == [1] and writers["bytes_per_rank"][1] == 0, writers  # nothing to storage itself
    assert writers["evacuated"] == {"1": {"to": 0, "bytes": shard}}, writers
    files = items_by_file(store, stop)
    assert set(files) == {"__0_0.distcp", "__1_0.distcp"} and files["__1_0.distcp"] > 1, files  # its shards
    assert writers["bytes_per_rank"][0] > shard + (store / step_dir(stop) / "__0_0.distcp").stat().st_size
    [safe] = pre.events("checkpoint_safe")
    assert (safe["rank"], safe["bytes"], safe["evacuated_to"], safe["evacuated_bytes"]) == (1, 0, 0, shard), safe
    [got] = pre.events("checkpoint_evacuation_received", 0)
    assert got["from_rank"] == 1 and got["bytes"] == shard
    commit_line = pre.events("checkpoint_committed", 1)[0]
    assert safe["timestamp"] <= commit_line["timestamp"]  # it stayed until the commit
    shown = subprocess.run([sys.executable, "-m", "spotguard", "checkpoints", str(store)], capture_output=True,
                           text=True, timeout=60)
    [row] = [ln for ln in shown.stdout.splitlines() if ln.split()[:1] == [str(stop)]]
    assert "notice on rank 1: wrote 0 B" in row and "(evacuated " in row and "to rank 0)" in row, row
    assert_models_resume_bitwise(tmp_path, args, pre, stop)


def assert_models_resume_bitwise(tmp_path: Path, args: list[str], pre: TorchRun, stop: int) -> None:
    """``_models_train.py --phase resume`` from ``stop``: both ranks resume there and every later loss equals
    the uninterrupted reference loop's (``pre``'s ``ref`` lines) bit for bit."""
    ref = {e["ref"]: e["hex"] for e in pre.lines() if "ref" in e}
    res = TorchRun(tmp_path / "res.log", [*args, "--phase", "resume"], script=MODELS)
    assert res.wait(180) == 0, res.tail()
    assert {e["rank"]: e["step"] for e in res.events("resumed")} == {0: stop, 1: stop}, res.tail()
    losses = {e["step"]: e["hex"] for e in res.lines() if "hex" in e and "step" in e and "ref" not in e}
    assert sorted(losses) == list(range(stop, MODEL_STEPS)) and losses == {k: ref[k] for k in losses}


def test_survivor_lost_before_commit_keeps_previous_newest(reference: Path, tmp_path: Path) -> None:
    """The survivor (rank 0, writing every replicated byte) dies after the doomed rank is safe and before the
    commit: nothing is committed for that step, the previous checkpoint stays newest, the doomed rank waited
    (it left only once its peer was gone), and the resume from the previous one is bitwise. This run acts at
    step boundaries (``SPOTGUARD_BACKGROUND_AGREEMENT=0``): the plan there is notice-aware too. The doomed rank
    evacuates (``SPOTGUARD_EVACUATE=always``): its file is only in the survivor's hands — received, acknowledged
    and uploaded — when the survivor dies, so the receiver's loss is what is tested."""
    store = tmp_path / "ckpt"
    first = preempt(tmp_path, store, "first", 4, 1, signal.SIGUSR1)
    assert first.wait() == 1, first.tail()
    prev = assert_agreed_exit(first)
    run = TorchRun(tmp_path / "lost.log", ["--steps", str(STEPS), "--step-time", "0.05", "--storage", str(store)],
                   env={"SPOTGUARD_TEST_SAVE_DELAY": "30", "SPOTGUARD_TEST_SAVE_DELAY_RANK": "0",
                        "SPOTGUARD_BACKGROUND_AGREEMENT": "0", "SPOTGUARD_EVACUATE": "always"})
    try:
        run.wait_step(prev + 3)
        run.signal_rank(1, signal.SIGUSR1)
        run.wait_for(lambda: bool(run.events("checkpoint_safe", 1)), 60, "the doomed rank safe")
        started = run.events("checkpoint_started", 0)
        assert started, run.tail()
        # DCP's .metadata and the doomed rank's file uploaded (the survivor's uploads run after DCP's gather
        # since the save is handed to the survivors, handoff.py): it is in its (test) delay before the commit
        run.wait_for(lambda: (store / step_dir(started[0]["step"]) / ".metadata").exists() and
                     bool(run.events("checkpoint_evacuation_received", 0)), 30,
                     "the survivor's shards, the doomed rank's file and DCP metadata")
        os.kill(run.pid(0), signal.SIGKILL)
        run.wait(90)
    finally:
        run.kill()
    step = started[0]["step"]
    assert step > prev
    assert committed(store) == [prev], committed(store)
    assert not (store / step_dir(step) / COMMIT_NAME).exists()
    assert run.events("checkpoint_committed") == []
    assert {e["rank"]: e.get("via") for e in run.events("agreed")} == {0: None, 1: None}  # the boundary path
    by_item = files_by_item(store, step)
    assert {k for k, f in by_item.items() if f.startswith("__1_")} == {rank_key(1)}, by_item
    [safe] = run.events("checkpoint_safe", 1)
    assert safe["evacuated_to"] == 0 and safe["bytes"] == 0, safe  # safe by the receiver's acknowledgement
    assert run.events("checkpoint_evacuation_received", 0)[0]["bytes"] == safe["evacuated_bytes"]
    exits = run.events("exit", 1)
    assert exits and exits[0]["committed"] is False, run.tail()
    assert run.events("checkpoint_safe", 1)[0]["timestamp"] <= exits[0]["timestamp"]
    resume_to_end(tmp_path, store, "resumed", prev, reference)
