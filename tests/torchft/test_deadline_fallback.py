"""Issue 25: a noticed replica group that cannot leave before its deadline writes its own checkpoint.

Real processes (the fallback leaves with ``os._exit``), a fake torchft manager (tests/torchft/_fallback_worker.py):
the steps after the notice never commit (the other groups left and ``min_replica_size`` is 2, or the quorum
stalls), so the vote never lets the group leave. Before the fallback such a group trained on uncommitted steps
until the VM died: nothing written. The checkpoint must be the state of the last committed step, bitwise (the
digest the worker recorded after that step's post-step work, the RNG right after its optimizer step).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("torchft")

from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import newest_committed  # noqa: E402
from tests.exactness.oracle import _Zygote  # noqa: E402

pytestmark = pytest.mark.serial

WORKER = Path(__file__).with_name("_fallback_worker.py")
ROOT = Path(__file__).resolve().parents[2]


_SERVER: list[_Zygote] = []


@pytest.fixture(scope="module", autouse=True)
def _fork_server() -> Iterator[None]:
    """The workers are forked from one server that imported torch (tests/exactness/_zygote.py: what each worker
    then runs is as ``python WORKER`` in its own session; ~2.5 CPU-seconds of imports a run less)."""
    yield
    for z in _SERVER:  # EOF: the server kills what it started and leaves
        assert z.proc.stdin is not None
        z.proc.stdin.close()
        z.proc.wait(30)
    _SERVER.clear()


def _run(tmp: Path, mode: str, **env: str) -> tuple[int, float, list[dict[str, Any]]]:
    e = dict(os.environ, PYTHONPATH=str(ROOT), SPOTGUARD_LOG_FORMAT="json", **env)
    if not _SERVER:
        _SERVER.append(_Zygote())
    log = tmp / f"worker-{mode}.log"
    t0 = time.monotonic()
    proc = _SERVER[0].start([str(WORKER), mode, str(tmp)], e, str(tmp), log)
    try:
        proc.wait(120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a worker's leftovers (or a hung one) go with it
    took = time.monotonic() - t0
    assert proc.returncode is not None
    return proc.returncode, took, _parse(log.read_text(errors="replace").splitlines())


def _parse(out: list[str]) -> list[dict[str, Any]]:
    """The JSON lines of a worker's output (torchrun's own lines and tracebacks are not JSON)."""
    lines = []
    for line in out:
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return lines


def _events(lines: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [ev for ev in lines if ev.get("event") == name]


def _recorded(tmp: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, (tmp / "digests.jsonl").read_text().splitlines())}


def _resumed(tmp: Path) -> tuple[int, str, str]:
    sys.path.insert(0, str(WORKER.parent))
    try:
        import _fallback_worker as w  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    model, opt, sched, mgr, guard = w.build(str(tmp / "ckpt"), str(tmp / "none.sock"))
    try:
        step = guard.resume()
        rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        return step, w.digest(model, opt, sched), rng
    finally:
        guard.hook.close()


def test_a_group_whose_steps_stop_committing_writes_the_last_committed_step_itself(tmp_path: Path) -> None:
    code, _, lines = _run(tmp_path, "stall", DEADLINE="4", NOTICE_AT="5")
    assert code == 143, lines[-5:]
    fb = _events(lines, "replica_fallback")
    assert fb and fb[0]["where"] == "watchdog"
    done = _events(lines, "checkpoint_committed")
    assert done and not _events(lines, "checkpoint_late")
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5  # steps 1..5 committed, none after the notice
    rec = _recorded(tmp_path)
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]


def test_a_notice_during_the_post_step_evaluation_is_written_at_the_next_training_forward(tmp_path: Path) -> None:
    # the fallback fires during the evaluation (the loop's post-step work may still change the state): the
    # write waits for the next training forward, which comes before the deadline
    code, _, lines = _run(tmp_path, "posteval", DEADLINE="5", EVAL="3.5", NOTICE_AT="4")
    assert code == 143, lines[-5:]
    fb = _events(lines, "replica_fallback")
    assert fb and fb[0]["where"] == "next-training-forward"
    rec = _recorded(tmp_path)
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]


@pytest.mark.parametrize("mode", ["posteval", "allleave"])
def test_a_write_that_cannot_start_before_the_deadline_exits_75_at_the_deadline(tmp_path: Path, mode: str) -> None:
    # the evaluation outlasts the deadline: no training forward comes; the process must not wait for it (the
    # VM is gone by then) nor claim anything: 75 at the deadline, an error line naming why
    code, _, lines = _run(tmp_path, mode, DEADLINE="3", EVAL="12", NOTICE_AT="4")
    assert code == 75, lines[-5:]
    missed = _events(lines, "replica_fallback_missed")
    assert missed and "before the deadline" in missed[0]["why"]
    assert not _events(lines, "checkpoint_committed")
    (ex,) = _events(lines, "exit")
    # left before the deadline (3 s), not after the 12 s evaluation, and never claiming a commit
    assert ex["by"] == "replica-deadline" and ex["seconds_since_notice"] < 3 and not ex["committed"]


def test_a_fallback_deferred_inside_a_committing_step_does_not_fire_after_the_group_left(tmp_path: Path) -> None:
    # the fallback fires while opt.step() runs (phase "stepping": deferred to the next training forward); the
    # step commits and the group leaves normally (143, its state lives on in the survivors). A process still
    # alive at the deadline (cleanup) must not then be killed with 75 and "replica_fallback_missed"
    code, _, lines = _run(tmp_path, "slowstep", DEADLINE="4", NOTICE_AT="5", SPOTGUARD_TORCHFT_FALLBACK_LEAD="3.5")
    assert _events(lines, "replica_fallback") and _events(lines, "replica_left")
    assert _events(lines, "worker_left")[0]["code"] == 143
    assert not _events(lines, "replica_fallback_missed"), _events(lines, "replica_fallback_missed")
    assert code == 143, lines[-5:]


def test_a_fallback_between_should_commit_and_the_optimizer_step_writes_the_step_the_state_is_at(
        tmp_path: Path) -> None:
    # torchft counts the step inside should_commit(); the optimizer steps after it. A watchdog write in between
    # (the optimizer is then held) holds the state of step 5: it must be labelled 5, not 6
    code, _, lines = _run(tmp_path, "commitrace", DEADLINE="4", NOTICE_AT="5", SPOTGUARD_TORCHFT_FALLBACK_LEAD="3.5")
    assert code == 143, lines[-5:]
    fb = _events(lines, "replica_fallback")
    assert fb and fb[0]["where"] == "watchdog"
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5
    rec = _recorded(tmp_path)
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]


def test_a_watchdog_write_never_runs_a_fake_optimizer_step_under_the_training_thread(tmp_path: Path) -> None:
    # plain SGD has no optimizer state: DCP's get_optimizer_state_dict() runs a fake step() (lr 0, zero grads,
    # zero_grad) when the gradients are None — from the watchdog, between the loop's forward and backward, it
    # bumped the parameters' version and the backward raised ("modified by an inplace operation"): the main
    # thread died mid-write, nothing committed
    code, _, lines = _run(tmp_path, "sgdstall", DEADLINE="4", NOTICE_AT="5")
    assert code == 143, lines[-5:]
    assert _events(lines, "checkpoint_committed")
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5


def test_a_fallback_before_any_committed_step_writes_nothing_and_says_so(tmp_path: Path) -> None:
    # no step ever committed (the first quorum stalls): a step-0 checkpoint would hold the RNG of the moment
    # (mid-iteration) and resume differently from a fresh start; nothing was trained, so nothing is written
    code, _, lines = _run(tmp_path, "stall", DEADLINE="3", NOTICE_AT="0")
    assert code == 143, lines[-5:]
    assert newest_committed(open_storage(str(tmp_path / "ckpt"))) is None
    (ex,) = _events(lines, "exit")
    assert ex["nothing_to_save"] and not ex["committed"]


def test_a_later_notice_with_a_nearer_deadline_moves_the_fallback_forward(tmp_path: Path) -> None:
    # a far notice (60 s: the fallback would write at 40 s), then a SIGTERM with a 4 s grace (a node drain): the
    # group still cannot leave (commits stalled) and must write by the SIGTERM's deadline, not the first one's
    code, took, lines = _run(tmp_path, "sigterm", DEADLINE="60", NOTICE_AT="5", SPOTGUARD_SIGNAL_GRACE="4")
    assert code == 143, lines[-5:]
    done = _events(lines, "checkpoint_committed")
    assert done and not _events(lines, "checkpoint_late")
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5
    rec = _recorded(tmp_path)
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]


@pytest.mark.parametrize("mode", ["stall", "posteval"])
def test_a_fallback_write_that_fails_exits_75_and_says_so(tmp_path: Path, mode: str) -> None:
    # held: the watchdog's write (stall) and the training thread's (posteval) both fail on the storage: 75,
    # checkpoint_failed naming the error, nothing claimed, before the deadline
    code, _, lines = _run(tmp_path, mode, DEADLINE="5", EVAL="2", NOTICE_AT="4", FAIL_WRITE="1")
    assert code == 75, lines[-5:]
    (failed,) = _events(lines, "checkpoint_failed")
    assert "No space left" in failed["error"]
    assert newest_committed(open_storage(str(tmp_path / "ckpt"))) is None
    (ex,) = _events(lines, "exit")
    assert not ex["committed"] and ex["seconds_since_notice"] < 5


def test_a_fallback_next_to_periodic_checkpoints_writes_the_last_committed_step(tmp_path: Path) -> None:
    # held: every= with keep=2 in the same storage (the writer group's periodic checkpoints before the notice):
    # the watchdog's write is the newest, step 5 exactly, and keep does not drop it (no upload is in flight at
    # the fallback here: with commits stalled no step boundary starts one)
    code, _, lines = _run(tmp_path, "stall", DEADLINE="4", NOTICE_AT="5", EVERY="0.01")
    assert code == 143, lines[-5:]
    assert _events(lines, "periodic_committed")
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5 and info.record.reason == "emergency"
    rec = _recorded(tmp_path)
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]


def _start(tmp: Path, name: str, mode: str, **env: str) -> subprocess.Popen[str]:
    (tmp / name).mkdir()
    e = dict(os.environ, PYTHONPATH=str(ROOT), SPOTGUARD_LOG_FORMAT="json", CKPT=str(tmp / "ckpt"), **env)
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(tmp / name)], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True)


def _until_ready(proc: subprocess.Popen[str]) -> list[str]:
    """Its output up to the line saying it waits at the notice step (all groups then take it together)."""
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if '"worker_ready"' in line:
            return seen
    raise AssertionError("worker ended before its notice step: " + "".join(seen[-5:]))


def _finish(proc: subprocess.Popen[str], before: list[str]) -> tuple[int, list[dict[str, Any]]]:
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, _parse(before + out.splitlines())


def test_a_whole_job_leave_whose_writer_fails_is_written_by_the_next_group(tmp_path: Path) -> None:
    # three groups noticed at once (a whole-job leave at step 6): the group of replica rank 0 writes. Its storage
    # fails (FAIL_WRITE) -> before, the other groups had already exited "143, the state lives on" with nothing in
    # storage; now they wait for the writer's commit, rank 1 writes the same step itself at deadline - lead and
    # rank 2 waits for that commit. (The writer that commits, the others leaving on seeing it:
    # tests/torchft/test_replicas.py's whole-job leave.)
    env = {"GROUPS": "3", "DEADLINE": "5", "NOTICE_AT": "5"}
    procs = [_start(tmp_path, f"g{r}", "allleave", REPLICA_RANK=str(r), **env, **({"FAIL_WRITE": "1"} if r == 0 else {}))
             for r in range(3)]
    before = [_until_ready(p) for p in procs]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    (c0, l0), (c1, l1), (c2, l2) = [_finish(p, b) for p, b in zip(procs, before)]
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 6, (l0[-3:], l1[-3:])  # the notice came before step 6
    assert c0 == 75 and _events(l0, "checkpoint_failed")
    assert c1 == 143 and _events(l1, "replica_failover") and _events(l1, "checkpoint_committed"), l1[-5:]
    assert c2 == 143 and _events(l2, "replica_written_by_peer") and not _events(l2, "checkpoint_started"), l2[-5:]
    rec = _recorded(tmp_path / "g1")
    step, dig, rng = _resumed(tmp_path)
    assert step == 6 and dig == rec[6]["digest"] and rng == rec[6]["rng"]


def test_a_group_of_two_processes_whose_steps_stop_committing_writes_the_step_together(tmp_path: Path) -> None:
    # one replica group of two processes (torchrun, gloo), the notice on rank 1 only, commits stalled after it:
    # before, rank 1's watchdog could not write the group's shards alone (75 at the deadline) and rank 0 trained
    # on until the VM died ("never left"). Now rank 1's watchdog wakes both ranks (torchrun's store) and they
    # write step 5 together on a gloo group of their own; both leave 143 committed
    e = dict(os.environ, PYTHONPATH=str(ROOT), SPOTGUARD_LOG_FORMAT="json", NOTICE_RANK="1", DEADLINE="6",
             NOTICE_AT="5")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), "stall", str(tmp_path)], env=e, capture_output=True, text=True, timeout=180)
    lines = _parse((proc.stdout + proc.stderr).splitlines())
    fb = [ev for ev in _events(lines, "replica_fallback") if ev.get("where") == "group"]
    assert {ev["rank"] for ev in fb} == {0, 1}, (proc.returncode, lines[-6:])
    # rank 0 heard of the notice through the group's vote, with rank 1's deadline (not a made-up 30 s grace)
    (heard,) = [ev for ev in _events(lines, "replica_leaving") if ev["rank"] == 0]
    assert heard["via"] == "group" and heard["seconds_left"] <= 6
    exits = _events(lines, "exit")
    assert {ev["rank"] for ev in exits} == {0, 1}
    assert all(ev["code"] == 143 and ev["committed"] for ev in exits), exits
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == 5 and info.record is not None
    assert info.record.world_size == 2 and info.record.reason == "emergency"
    rec = _recorded(tmp_path)  # both ranks hold one state (same data and seed); loaded here on one process
    step, dig, rng = _resumed(tmp_path)
    assert step == 5 and dig == rec[5]["digest"] and rng == rec[5]["rng"]
