"""The daemon in a real cluster's life, under a REAL 2-rank ``torchrun`` job (gloo, CPU):

- a daemon rollout (SIGTERM, a new daemon on the same socket) and then a plain stop (SIGINT) and restart leave
  training untouched, and a later notice through the newest daemon still ends in a committed checkpoint and a
  bitwise resume (one job for both);
- a far emergency deadline (GCP GPU host maintenance: an hour ahead) keeps training, and the
  emergency checkpoint commits ``SPOTGUARD_EMERGENCY_LEAD`` before the deadline;
- (the hook's SIGTERM grace, ``SPOTGUARD_SIGNAL_GRACE``: test_torchrun's term-to-rank1 case, in its job).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from spotguard.launch import DaemonProc, query_status, start_daemon

from ._daemons import drill, subscribers, wait_subscribed, wait_until
from ._torchrun import TorchRun, reference_run
from .test_daemon_e2e import assert_daemon_saw_done, drill_when_running
from .test_torchrun import STEPS, assert_agreed_exit, committed, resume_to_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.serial]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def _reconnecting(run: TorchRun) -> dict[int, int]:
    """Rank -> how many "lost connection ...; reconnecting" lines its intake wrote so far."""
    out = {0: 0, 1: 0}
    for e in run.lines():
        if "reconnecting" in str(e.get("event")) and e.get("rank") in out:
            out[e["rank"]] += 1
    return out


def test_daemon_rollout_and_restart_leave_training_untouched_and_the_successor_delivers(
        short_tmp: Path, tmp_path: Path, reference: Path) -> None:
    """One job, two daemon replacements on its socket: a rollout (SIGTERM) and a plain stop (SIGINT,
    ``DaemonProc.stop``), each followed by a new daemon; the hook re-subscribes each time (same workers, no
    restart), training goes on untouched, and a drill through the third daemon commits and resumes bitwise.
    (The stop was ``test_daemon_e2e``'s own restart test, with a torchrun job of its own: merged here.)"""
    sock, store = str(short_tmp / "d.sock"), tmp_path / "ckpt"
    daemons: list[DaemonProc] = [start_daemon(sock, cloud="none", log_path=tmp_path / "daemon-1.log")]
    # 30 steps x 0.8 s: room for two replacements and the drill before the job would end.
    run = TorchRun(tmp_path / "roll.log", ["--steps", str(STEPS), "--step-time", "0.8", "--storage", str(store)],
                   env={"SPOTGUARD_SOCKET": sock})
    try:
        wait_subscribed(sock, {0, 1}, run)
        pids = {s["rank"]: s["pid"] for s in subscribers(sock)}
        run.wait_step(2)
        t0 = time.monotonic()
        daemons[0].proc.send_signal(signal.SIGTERM)  # the rollout
        assert daemons[0].proc.wait(10) == 0
        assert time.monotonic() - t0 <= 2.5  # <= 2 s in the daemon; process start-up noise on top
        daemons.append(start_daemon(sock, cloud="none", log_path=tmp_path / "daemon-2.log"))
        wait_subscribed(sock, {0, 1}, run)  # the same workers re-subscribed to the successor
        assert {s["rank"]: s["pid"] for s in subscribers(sock)} == pids
        step_at_roll = max(run.steps())
        run.wait_step(step_at_roll + 1)  # training went on, untouched
        assert run.events("notice_seen") == [] and run.events("agreed") == []

        # The restart: a plain stop; both intakes notice the daemon went away (their log lines, not a sleep).
        before = _reconnecting(run)
        assert daemons[1].stop() == 0
        wait_until(lambda: all(n > before[r] for r, n in _reconnecting(run).items()), 20,
                   "both intakes to notice the lost daemon", run)
        step_at_restart = max(run.steps())
        daemons.append(start_daemon(sock, cloud="none", log_path=tmp_path / "daemon-3.log"))
        assert query_status(sock)["pid"] == daemons[2].proc.pid
        wait_subscribed(sock, {0, 1}, run)  # the hook re-subscribed to the new daemon
        assert {s["rank"]: s["pid"] for s in subscribers(sock)} == pids  # the same workers, not a restart
        notice_id = drill_when_running(run, sock, {0, 1}, step_at_restart + 1)
        assert run.wait(60) == 1, run.tail()
        stop = assert_agreed_exit(run)
        assert stop > step_at_restart > step_at_roll  # training went on while the daemons were away
        assert committed(store) == [stop]
        assert {e["notice_id"] for e in run.events("checkpoint_committed")} == {notice_id}
        assert_daemon_saw_done(sock, notice_id, {0, 1}, stop, store)
    finally:
        run.kill()
        for d in reversed(daemons):
            d.stop()
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
