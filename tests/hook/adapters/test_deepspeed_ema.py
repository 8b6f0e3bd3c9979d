"""DeepSpeed: ``add_state`` objects the loop changes after ``engine.step()`` (issue 29's review, oracle pattern
``deepspeed_zero2_ema``): an EMA updated right after the step and a meter updated before it.

A notice lands while the loop sleeps after its EMA update (between step S and the next forward). The checkpoint of
S must hold the EMA with update S and the meter as at the next iteration's first forward; before the fix the
adapter copied them at the end of ``engine.step()`` (the EMA one update behind, so the resumed run never applied
update S). Both ways of acting: the any-moment path and the boundary path (``SPOTGUARD_BACKGROUND_AGREEMENT=0``).
Two edges of "read at the anchor" (the engine's first training forward after S): a notice after the last step
(no anchor comes: the read is taken in ``destroy_process_group()``), and an evaluation under ``no_grad`` between
S and the anchor (not the anchor, not held). Real deepspeed, torchrun, 2 ranks, gloo, CPU; the comm op prebuilt
(test_deepspeed.py's ``ds_env``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")

import torch  # noqa: E402

from spotguard.hook.adapters.deepspeed import SpotguardCheckpointEngine  # noqa: E402
from spotguard.hook.state import unpack  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import scan  # noqa: E402

from ._jobs import Job, Reference, assert_agreed_exit, load_out, preempt_and_resume, read_log  # noqa: E402
from .test_deepspeed import ds_env  # noqa: E402, F401 - the CPU accelerator and the prebuilt comm op

SCRIPT = "../tests/hook/adapters/deepspeed_ema_train.py"  # Job runs examples/<script>
STEPS = 8

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOUNDARY = {"SPOTGUARD_BACKGROUND_AGREEMENT": "0"}
# a short grace: a round that waited for an anchor that never comes gives up after ~8 s, not ~28 s
SHORT_GRACE = {"SPOTGUARD_SIGNAL_GRACE": "10"}


@pytest.mark.parametrize("path", ["any-moment", "boundary"])
def test_ema_updated_after_engine_step_is_saved_with_its_update_and_resumes_bitwise(tmp_path: Path,
                                                                                     path: str) -> None:
    env = BOUNDARY if path == "boundary" else {}
    ref = Reference(SCRIPT, tmp_path, STEPS)
    try:
        stop = preempt_and_resume(SCRIPT, tmp_path, ref, STEPS, 2, "usr1-rank1", marker="spotguard_rank1.pt",
                                  step_time="0.6", env=env)  # final weights, EMA and meter compared bitwise
    finally:
        ref.run.kill()
    run = read_log(tmp_path / "preempted.log")
    assert {e["rank"]: e["path"] for e in run.events("notice_path")} == {0: path, 1: path}, run.tail()
    assert stop >= 3, stop


def _assert_holds(folder: Path, want: dict[str, torch.Tensor]) -> None:
    """The committed checkpoint in ``folder`` holds ``want`` (rank 0's ``--out`` model dict) bitwise: the module's
    weights (DeepSpeed's model file), and every rank's EMA (ZeRO-2: whole parameters, equal on both ranks), rank
    0's meter and best-metric tracker (spotguard's per-rank file)."""
    for rank in (0, 1):
        state = unpack((folder / f"spotguard_rank{rank}.pt").read_bytes(), f"rank{rank}")["state"]
        ema = state["ema"]
        assert ema.keys() and all(torch.equal(t, want[f"ema.{n}"]) for n, t in ema.items()), (rank, ema)
        if rank == 0:
            for key, (a, b) in {"meter": ("total", "n"), "best": ("best", "evals")}.items():
                got = torch.tensor([state[key][a], float(state[key][b])], dtype=torch.float64)
                assert torch.equal(got, want[key]), (key, got, want[key])
    ce = SpotguardCheckpointEngine(open_storage(str(folder.parent)), "x", str(folder))
    module = ce.load(str(folder / "mp_rank_00_model_states.pt"))["module"]
    assert module.keys() and all(torch.equal(t, want[n]) for n, t in module.items()), module.keys()


@pytest.mark.serial
@pytest.mark.parametrize("path", ["any-moment", "boundary"])
def test_a_notice_after_the_last_step_is_read_at_destroy_process_group_with_the_last_ema_update(
        tmp_path: Path, path: str) -> None:
    """The notice comes after the loop's last ``engine.step()`` and its EMA update; no training forward follows.
    The round (any-moment) or the boundary (boundary path) waits for the anchor of the next iteration, which never
    comes: ``destroy_process_group()`` is where the loop's work is known to be over, and the last step is committed
    there with the EMA and meter as the loop left them (equal to the job's own final state, bitwise), promptly,
    nothing else written, exit 143 on both ranks, from ``destroy_process_group()`` by the training thread. Broken
    (``_quiesce`` serving nothing): no commit."""
    steps, store, final = 4, tmp_path / "ckpt", tmp_path / "final.pt"
    run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(steps), "--storage", str(store), "--out",
                                                    str(final), "--notice-after", str(steps - 1)],
              env={**SHORT_GRACE, **(BOUNDARY if path == "boundary" else {})})
    try:
        assert run.wait(90) != 0, run.tail()
    finally:
        run.kill()
    assert {e["rank"]: e["path"] for e in run.events("notice_path")} == {0: path, 1: path}, run.tail()
    assert assert_agreed_exit(run) == steps  # 143, committed, on both ranks
    took = [e["seconds_since_notice"] for e in run.events("checkpoint_committed")]
    assert took and max(took) < 6.0, took  # read at destroy_process_group(), not at a give-up bound (~8 s)
    # and left from there at once, by the training thread (before: the agreement thread's os._exit after
    # SPOTGUARD_EXIT_GRACE, ~1 s after the commit)
    exits = run.events("exit")
    assert {e["by"] for e in exits} == {"training-thread"}, exits
    assert [(c.step, c.committed) for c in scan(open_storage(str(store)))] == [(steps, True)]
    _assert_holds(store / f"step-{steps:08d}", load_out(final)["model"])  # rank 0's state after the loop


def test_an_evaluation_between_the_step_and_the_anchor_is_not_held_and_not_the_anchor(tmp_path: Path) -> None:
    """Any-moment path: the emergency comes right after ``engine.step()`` S and the EMA update, and its round waits
    for the anchor; then the loop evaluates (``engine.eval()``, ``engine(x)`` under ``torch.no_grad()``) and
    updates a best-metric tracker, before the next training forward. That evaluation forward is not held (held,
    the anchor never comes: nothing committed) and is not the anchor (the tracker would be saved without the
    evaluation). S commits at the next training forward, holding what the uninterrupted run holds at S (its run
    of S steps, evaluation included): weights, EMA, meter, tracker, bitwise. (That DeepSpeed's own load of such
    a checkpoint resumes bitwise: this module's first test; the boundary path's anchor and an evaluation in between:
    test_deepspeed_inproc.py's ``every=`` test.)"""
    steps, at = 6, 2  # iteration 2 ends global step 3
    args = ("--eval-at", str(at))
    ref = Reference(SCRIPT, tmp_path, at + 1, args)  # the uninterrupted run to S, beside the preempted job
    try:
        run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(steps), "--storage", str(tmp_path / "ckpt"),
                                                        "--notice-after", str(at), *args], env=SHORT_GRACE)
        try:
            assert run.wait(90) != 0, run.tail()
        finally:
            run.kill()
        assert {e["rank"]: e["path"] for e in run.events("notice_path")} == {0: "any-moment", 1: "any-moment"}, \
            run.tail()
        assert [e["eval"] for e in run.lines() if "eval" in e] == [at], run.tail()  # it ran, before the exit
        stop = assert_agreed_exit(run)
        assert stop == at + 1, (stop, run.tail())
        assert [(c.step, c.committed) for c in scan(open_storage(str(tmp_path / "ckpt")))] == [(stop, True)]
        _assert_holds(tmp_path / "ckpt" / f"step-{stop:08d}", load_out(ref.result()[1])["model"])
    finally:
        ref.run.kill()
