"""Issue 23 (time to safe, Lightning): a notice during gradient accumulation commits the last optimizer step S.

Real torchrun (2 ranks, DDP/gloo, CPU), a real ``spotguard daemon``, ``accumulate_grad_batches=8`` with
1 s micro-batches (an 8 s accumulation) and a drill whose deadline (5 s) is shorter than the accumulation.
Before, the notice was acted on at the end of the next optimizer step (here 8-16 s later): committed late,
exit 75. Now every rank commits the checkpoint of the last completed optimizer step S (the micro-batches after
S are thrown away), in time, exit 143 — written from the background at once (the any-moment path,
``lightning_anymoment.py``) — and the restarted job recomputes those micro-batches and ends bitwise equal to an
uninterrupted run (every micro-batch's loss, final weights). A notice during a validation that runs between two
micro-batches (that configuration keeps the micro-batch path) is acted on at the validation's next batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from spotguard.daemon.client import request_sync
from spotguard.launch import DaemonProc
from spotguard.protocol import DrillCancel

from .._daemons import drill
from .._torchrun import TorchRun, first_difference, load_out
from ._jobs import Job, committed, drill_beside_reference

pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]

SCRIPT = "lightning_train.py"
ACCUM = 8
STEPS = 4
S = 1  # the notice comes during the accumulation of step S+1 (batches 8..15): S is the last completed step


def _args(accum: int) -> list[str]:
    return ["--steps", str(STEPS), "--accumulate", str(accum), "--batches-per-epoch", "40"]


MICRO_BATCH_TIME = "1.0"
DEADLINE = 5.0  # shorter than the 8 s accumulation, longer than a micro-batch plus the save


def _micro(run: TorchRun) -> dict[tuple[int, int, int], str]:
    """(optimizer step, epoch, batch index) -> that micro-batch's loss as ``float.hex``, rank 0's lines."""
    return {(e["step"], e["epoch"], e["batch"]): e["hex"] for e in run.lines() if "hex" in e and "batch" in e}


def _preempt_and_resume(tmp_path: Path, daemon: DaemonProc, args: list[str], reference_args: list[str],
                        fired: Callable[[TorchRun], bool], deadline: float, accum: int = ACCUM) -> TorchRun:
    """Reference run, preempted run (drill once ``fired``), checks of the commit of step S, resumed run compared
    micro-batch by micro-batch with the reference; returns the preempted run. The reference (no sleeps) runs
    beside the preempted job, which sleeps through its micro-batches: it costs no wall time of its own."""
    args_ = _args(accum)
    ref = Job(SCRIPT, tmp_path / "ref.log", [*args_, *reference_args, "--no-hook", "--out", str(tmp_path / "ref.pt")])
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log", [*args_, *args, "--storage", str(store)],
              env={"SPOTGUARD_SOCKET": daemon.socket})
    notice_id = drill_beside_reference(ref, run, daemon.socket, lambda: fired(run), deadline, drill)
    request_sync(daemon.socket, DrillCancel(id=notice_id))  # the restarted job must not get it replayed
    reference = _micro(ref)
    assert len(reference) == STEPS * accum, ref.tail()

    seen = _micro(run)
    assert max(k[0] for k in seen) == S, "an optimizer step ran after the notice"
    assert len([k for k in seen if k[0] == S]) < accum, "the accumulation ran to its end before the exit"
    for name in ("agreed", "checkpoint_committed"):
        got = {e["rank"]: e["step"] for e in run.events(name) if e.get("notice_id") == notice_id}
        assert got == {0: S, 1: S}, (name, got, run.tail())
    assert not run.events("checkpoint_late"), run.events("checkpoint_late")
    # the hook acts one micro-batch away now: its estimate at the notice is that, not the whole accumulation
    assert not run.events("deadline_at_risk"), run.events("deadline_at_risk")
    for e in run.events("checkpoint_committed"):
        assert e["seconds_left"] > 0, e
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1}, run.tail()
    for e in exits.values():
        assert e["code"] == 143 and e["committed"] and not e["late"] and e["notice_id"] == notice_id, e
    assert committed(store) == [S]

    resumed = Job(SCRIPT, tmp_path / "resumed.log", [*args_, *reference_args, "--storage", str(store), "--out",
                                                      str(tmp_path / "resumed.pt")])
    assert resumed.wait(180) == 0, resumed.tail()
    assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {0: S, 1: S}, resumed.tail()
    again = _micro(resumed)
    # the resumed job starts at the first micro-batch after step S: the thrown-away ones are recomputed
    assert sorted(again) == sorted(k for k in reference if k[0] >= S), sorted(again)[:3]
    diff = [(k, reference[k], again[k]) for k in sorted(again) if reference[k] != again[k]]
    assert not diff, f"resumed micro-batch losses differ from the uninterrupted run (key, ref, resumed): {diff[:4]}"
    for what in ("model", "optimizer"):
        d = first_difference(load_out(tmp_path / "ref.pt")[what], load_out(tmp_path / "resumed.pt")[what])
        assert d is None, f"final {what} state differs at {d}"
    return run


def test_notice_during_accumulation_commits_last_step_in_time_and_resumes_bitwise(
        tmp_path: Path, daemon: DaemonProc) -> None:
    _preempt_and_resume(tmp_path, daemon, ["--step-time", MICRO_BATCH_TIME], [],
                        lambda run: any(k[0] == S for k in _micro(run)), DEADLINE)


def test_notice_during_validation_between_micro_batches_commits_last_step(tmp_path: Path, daemon: DaemonProc) -> None:
    """Validation every 14 batches with 8 a step: the first one runs between micro-batches 6 and 7 of step S+1
    (gradients partly accumulated). A notice there is saved rewound to step S, as at a micro-batch's end (before,
    the save took Lightning's mid-accumulation loop position: the resume skipped micro-batches)."""
    run = _preempt_and_resume(
        tmp_path, daemon, ["--eval-every", "14", "--eval-batches", "40", "--eval-step-time", "0.5"],
        ["--eval-every", "14", "--eval-batches", "2"],
        lambda run: any(e.get("val_batch", -1) >= 1 for e in run.lines()), 8.0)
    assert {e["step"] for e in run.lines() if "val_batch" in e} == {S}  # the notice landed in that validation


@pytest.mark.long(reason="~140 s on a loaded box; test_notice_during_accumulation_commits_last_step_in_time_and_"
                         "resumes_bitwise takes the same any-moment path with accumulation in make test")
def test_notice_micro_batches_after_the_step_commits_it_within_a_second_and_resumes_bitwise(
        tmp_path: Path, daemon: DaemonProc) -> None:
    """Issue 23's any-moment path with accumulation (``lightning_anymoment.py``): accumulation 4, 2 s micro-batches,
    a notice inside the third micro-batch after S. The agreement thread writes S at once (the micro-batches after
    it are thrown away, S's loop progress and RNG copied at its last micro-batch's end); before, the micro-batch
    path acted at the end of the micro-batch in flight, up to 2 s later."""
    run = _preempt_and_resume(tmp_path, daemon, ["--step-time", "2.0"], [],
                              lambda run: (S, 0, 4 * S + 1) in _micro(run), 4.0, accum=4)
    assert {e.get("via") for e in run.events("agreed")} == {"background"}, run.events("agreed")
    late = [e["seconds_since_notice"] for e in run.events("checkpoint_committed")]
    assert late and max(late) < 1.5, late  # not at the micro-batch's end (2 s micro-batches)
    assert ("any-moment", "lightning") in {(e["path"], e["loop"]) for e in run.events("notice_path")}
