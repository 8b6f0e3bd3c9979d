"""The daemon in a real cluster's life, under a REAL 2-rank ``torchrun`` job (gloo, CPU):

- a daemon rollout (SIGTERM, a new daemon on the same socket) leaves training untouched, and a later
  notice through the new daemon still ends in a committed checkpoint and a bitwise resume;
- a far emergency deadline (GCP GPU host maintenance: an hour ahead) keeps training, and the
  emergency checkpoint commits ``SPOTGUARD_EMERGENCY_LEAD`` before the deadline;
- the hook's SIGTERM grace is ``SPOTGUARD_SIGNAL_GRACE`` (GKE 15 s, torchrun 30 s).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from spotguard.launch import DaemonProc, start_daemon

from ._daemons import drill, subscribers, wait_subscribed, wait_until
from ._torchrun import TorchRun, reference_run
from .test_torchrun import STEPS, assert_agreed_exit, committed, resume_to_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def test_daemon_rollout_leaves_training_untouched_and_the_successor_delivers(short_tmp: Path, tmp_path: Path,
                                                                            reference: Path) -> None:
    sock, store = str(short_tmp / "d.sock"), tmp_path / "ckpt"
    first = start_daemon(sock, cloud="none", log_path=tmp_path / "daemon-1.log")
    second: DaemonProc | None = None
    # 30 steps x 0.4 s: room for the rollout and the drill before the job would end.
    run = TorchRun(tmp_path / "roll.log", ["--steps", str(STEPS), "--step-time", "0.4", "--storage", str(store)],
                   env={"SPOTGUARD_SOCKET": sock})
    try:
        wait_subscribed(sock, {0, 1}, run)
        pids = {s["rank"]: s["pid"] for s in subscribers(sock)}
        run.wait_step(2)
        t0 = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)  # the rollout
        assert first.proc.wait(10) == 0
        assert time.monotonic() - t0 <= 2.5  # <= 2 s in the daemon; process start-up noise on top
        second = start_daemon(sock, cloud="none", log_path=tmp_path / "daemon-2.log")
        wait_subscribed(sock, {0, 1}, run)  # the same workers re-subscribed to the successor
        assert {s["rank"]: s["pid"] for s in subscribers(sock)} == pids
        step_at_roll = max(run.steps())
        run.wait_step(step_at_roll + 1)  # training went on, untouched
        assert run.events("notice_seen") == [] and run.events("agreed") == []
        notice_id = drill(sock, deadline_in=60)
        assert run.wait(60) == 1, run.tail()
        stop = assert_agreed_exit(run)
        assert stop > step_at_roll and committed(store) == [stop]
        assert {e["notice_id"] for e in run.events("checkpoint_committed")} == {notice_id}
    finally:
        run.kill()
        if second is not None:
            second.stop()
        first.stop()
    resume_to_end(tmp_path, store, "resumed", stop, reference)


def test_far_emergency_deadline_keeps_training_and_commits_before_the_window(short_tmp: Path,
                                                                             tmp_path: Path) -> None:
    sock, store = str(short_tmp / "f.sock"), tmp_path / "ckpt"
    lead, deadline_in = 3.0, 7.0
    daemon = start_daemon(sock, cloud="none", log_path=tmp_path / "daemon.log")
    run = TorchRun(tmp_path / "far.log", ["--steps", "600", "--step-time", "0.1", "--storage", str(store)],
                   env={"SPOTGUARD_SOCKET": sock, "SPOTGUARD_EMERGENCY_LEAD": str(lead)})
    try:
        wait_subscribed(sock, {0, 1}, run)
        run.wait_step(2)
        notice_id = drill(sock, kind="termination", deadline_in=deadline_in)
        assert run.wait(60) == 1, run.tail()
    finally:
        run.kill()
        daemon.stop()
    deferred = {e["rank"]: e for e in run.events("notice_deferred")}
    assert set(deferred) == {0, 1} and all(e["notice_id"] == notice_id for e in deferred.values()), deferred
    agreed = {e["rank"]: e for e in run.events("agreed")}
    assert all(e["action"] == "emergency" for e in agreed.values()), agreed
    # Not at once: the ranks trained on until about `lead` seconds before the deadline ...
    assert all(0 < e["seconds_left"] <= lead + 0.5 for e in agreed.values()), agreed
    assert all(e["seconds_since_notice"] >= deadline_in - lead - 1.0 for e in agreed.values()), agreed
    # ... and the checkpoint committed before the deadline.
    stop = assert_agreed_exit(run)
    assert committed(store) == [stop]
    assert all(e["seconds_left"] > 0 for e in run.events("checkpoint_committed")), run.events("checkpoint_committed")


def test_signal_grace_is_configurable(tmp_path: Path) -> None:
    run = TorchRun(tmp_path / "grace.log", ["--steps", "600", "--step-time", "0.05",
                                            "--storage", str(tmp_path / "ckpt")],
                   env={"SPOTGUARD_SIGNAL_GRACE": "15"})
    try:
        run.wait_step(2)
        run.signal_rank(1, signal.SIGTERM)
        assert run.wait(60) == 1, run.tail()
    finally:
        run.kill()
    seen = [e for e in run.events("notice_seen") if e["via"] == "signal"]
    assert seen and all(10 < e["seconds_left"] <= 15 for e in seen), seen
    wait_until(lambda: committed(tmp_path / "ckpt"), 5, "the commit")
