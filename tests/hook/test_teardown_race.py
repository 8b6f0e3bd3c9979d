"""The user's ``destroy_process_group()`` right after the last step: the hook quiesces first, never crashes.

Regression for an intermittent abort at the end of a run ("terminate called
without an active exception", torchrun -6): the hook's last per-step flag
reduction, launched at the final step's post-hook on its own gloo group, could
still be in flight while the user tore the groups down. The hook now wraps
``destroy_process_group`` to wait (bounded) for it, then drops its own groups.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch.distributed as dist

from spotguard.hook import Hook, events
from spotguard.hook import dist as sgdist
from spotguard.hook.dist import group_alive

from ._torchrun import TorchRun
from .test_boundary import make, notice, one_iteration

WORKER = Path(__file__).resolve().parent / "_teardown_worker.py"
REPO = Path(__file__).resolve().parents[2]


def test_destroy_quiesces_the_hook_in_process(tmp_path: Path) -> None:
    """One rank, real gloo: destroy waits for the flag reduction, drops the hook's group, later notices are late."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    s = make()
    h = Hook(s, str(tmp_path / "ck"), signals=False, intake=False, every=3600)
    try:
        h.resume()
        for _ in range(3):
            one_iteration(s)
        assert h._agree.pending  # launched at the last post-hook, never collected by a boundary
        group, pgroup = h._group, h._periodic.group
        assert getattr(dist.destroy_process_group, "__spotguard__", False)
        with structlog.testing.capture_logs() as logs:
            dist.destroy_process_group()
            assert h._life.torn_down and not h._agree.pending
            assert not group_alive(group) and not group_alive(pgroup) and not dist.is_initialized()
            h.notify(notice())
            one_iteration(s)  # a step after teardown launches nothing
            assert not h._agree.pending
            h._at_exit()
        assert any(e["event"] == events.NOTICE_AFTER_LAST_STEP for e in logs)
        assert not any(e["event"] == events.CHECKPOINT_STARTED for e in logs)
    finally:
        h.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    # The wrapper is installed once and stays transparent.
    assert dist.destroy_process_group is sgdist._guarded_destroy
    assert dist.distributed_c10d.destroy_process_group is sgdist._guarded_destroy


def _pair(tmp: Path, rounds: int, *extra: str) -> list[tuple[int, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for rank in (0, 1):
        log = open(tmp / f"rank{rank}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), str(rank), str(rounds), str(tmp), *extra],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log))
    out = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            rc = -9
        log.close()
        out.append((rc, (tmp / f"rank{rank}.log").read_text(errors="replace")))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [["--no-barrier", "--late-notice"], []], ids=["no-barrier+late-notice", "barrier"])
def test_many_short_jobs_destroy_right_after_last_step(tmp_path: Path, mode: list[str]) -> None:
    """20 rounds per process of init -> steps with no step time -> destroy; then interpreter exit: always 0."""
    for rc, text in _pair(tmp_path, 20, *mode):
        assert rc == 0 and "terminate called" not in text, text[-3000:]
        assert '"ok": true' in text
        if "--late-notice" in mode:
            assert "notice_after_last_step" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.long(reason="sibling in make test: test_many_short_jobs_destroy_right_after_last_step[barrier] (20 "
                         "rounds a process of steps with no step time, barrier, destroy right after the last step: "
                         "exit 0) and every resumed example job of test_torchrun.py (no step time, its barrier + "
                         "destroy at the end, exit 0 asserted)")
def test_short_torchrun_jobs_exit_zero(tmp_path: Path) -> None:
    """The example under torchrun with no step time (barrier + destroy at the end), twice: exit 0 each time."""
    for i in range(2):
        run = TorchRun(tmp_path / f"run{i}.log", ["--steps", "6", "--storage", str(tmp_path / f"ck{i}")])
        rc = run.wait()
        text = run.log.read_text(errors="replace")
        assert rc == 0 and "terminate called" not in text, run.tail()




FINISHED_PEER = Path(__file__).resolve().parent / "_finished_peer_worker.py"


@pytest.mark.timeout(120)
def test_notice_after_the_peers_finished_keeps_the_finished_job(tmp_path: Path) -> None:
    """A notice in rank 1's last iteration (after its last all-reduce) while rank 0 already tore down: the
    round cannot be agreed, but the job's work is done — ``notice_after_last_step``, both ranks exit 0.

    Found by ``make exactness`` (pattern ddp_every_step): rank 1 exited 75 (``peers_lost``), torchrun then
    killed rank 0 in its teardown, and a finished job would have been restarted."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, str(FINISHED_PEER), str(r), str(tmp_path)], env=env,
                              stdout=open(tmp_path / f"rank{r}.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True) for r in (0, 1)]
    try:
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert codes == [0, 0], (codes, logs[1][-3000:])
    assert '"ok": true' in logs[0] and '"ok": true' in logs[1]
    assert events.NOTICE_AFTER_LAST_STEP in logs[1] and "every other rank had finished" in logs[1], logs[1][-3000:]
    assert events.PEERS_LOST not in logs[1] and "checkpoint_started" not in logs[1]
