"""Real daemon processes in a cluster's life: a rollout (SIGTERM, successor on the same socket) never
stops training, a failing log stream never stops a notice, and ``spotguard wait-checkpoint`` holds a
preStop / ExecStop until every local trainer reported its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

from spotguard.daemon.client import Subscription
from spotguard.hook.intake import NoticeIntake
from spotguard.launch import Emulator, query_status, start_daemon, start_emulator
from spotguard.notice import Notice

from .conftest import REPO

CLI = [sys.executable, "-m", "spotguard"]


def drill(sock: str, kind: str = "preemption", deadline_in: float = 60) -> str:
    out = subprocess.run([*CLI, "drill", "--socket", sock, "--kind", kind, "--deadline-in", str(deadline_in),
                          "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["id"])


class Trainer:
    """The hook's real notice intake, as a trainer process runs it (a thread with its own socket)."""

    def __init__(self, sock: str, rank: int) -> None:
        self.notices: list[Notice] = []
        self.got = threading.Event()
        self.intake = NoticeIntake(sock, rank=rank, local_rank=rank, world_size=2, job="roll",
                                   on_notice=self._on_notice)
        self.intake.start()

    def _on_notice(self, notice: Notice) -> None:
        self.notices.append(notice)
        self.got.set()

    def close(self) -> None:
        self.intake.close()


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    emu = start_emulator()
    try:
        yield emu
    finally:
        emu.stop()


def test_sigterm_is_a_clean_stop_within_2s_and_trainers_keep_their_subscription(emulator: Emulator,
                                                                               sockdir: str) -> None:
    """A DaemonSet rollout / systemctl restart: no notice, exit 0 within 2 s (with a metadata request
    hanging), the socket path free for the successor, and the intakes re-subscribe to it."""
    sock = os.path.join(sockdir, "roll.sock")
    emulator.control("fault", {"mode": "hang", "cloud": "aws", "path": "/latest/meta-data/spot"})
    old = start_daemon(sock, cloud="aws", metadata_url=emulator.url, log_path=None)
    trainers = [Trainer(sock, r) for r in (0, 1)]
    new = None
    try:
        assert all(t.intake.wait_connected(10) for t in trainers)
        t0 = time.monotonic()
        old.proc.send_signal(signal.SIGTERM)
        rc = old.proc.wait(10)
        stopped = time.monotonic() - t0
        assert rc == 0 and stopped <= 2.0, (rc, stopped)
        assert not os.path.exists(sock), "the socket path must be free for the successor"
        assert all(not t.got.is_set() for t in trainers), "a SIGTERM to the daemon must not be a notice"
        new = start_daemon(sock, cloud="none")
        for t in trainers:  # same intakes, same threads: reconnected to the successor
            assert t.intake.wait_connected(10)
        end = time.monotonic() + 10
        while len(query_status(sock)["subscribers"]) < 2 and time.monotonic() < end:
            time.sleep(0.05)  # another process's state: polled
        notice_id = drill(sock)
        for t in trainers:
            assert t.got.wait(10) and [n.id for n in t.notices] == [notice_id]
    finally:
        for t in trainers:
            t.close()
        if new is not None:
            new.stop()
        old.stop()


def test_overlapping_successor_takes_the_socket_once_the_predecessor_stops(spawn_daemon: Any) -> None:
    """A rollout that starts the new daemon before the old one is gone (surge): it waits, then serves."""
    old = spawn_daemon()
    new = spawn_daemon("--log-level", "debug", sock=old.sock, wait_ready=False)
    end = time.monotonic() + 20
    while "socket.busy_waiting" not in new.stderr_now():  # its log file: polled
        assert new.proc.poll() is None and time.monotonic() < end, new.stderr_now()
        time.sleep(0.02)
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(10) == 0
    new.wait_notify("READY=1")
    assert query_status(new.sock)["pid"] == new.proc.pid


def test_sigterm_notice_option_restores_the_termination_notice(sockdir: str) -> None:
    sock = os.path.join(sockdir, "n.sock")
    d = start_daemon(sock, env={"SPOTGUARD_SIGTERM_NOTICE": "1", "SPOTGUARD_SIGTERM_GRACE": "1"})
    trainer = Trainer(sock, 0)
    try:
        assert trainer.intake.replayed.wait(10)  # subscribed: the daemon answered after it
        d.proc.send_signal(signal.SIGTERM)
        assert trainer.got.wait(10)
        assert (trainer.notices[0].source, trainer.notices[0].kind) == ("signal", "termination")
        assert d.proc.wait(10) == 0
    finally:
        trainer.close()
        d.stop()


# --- logging can never block or break delivery -----------------------------------------


def _close_stdout_and_stderr() -> None:
    os.close(1)
    os.close(2)


def _daemon_with_output(sock: str, out: Any) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    closed = out is None  # no stdout/stderr at all (fds 1 and 2 closed before exec)
    return subprocess.Popen([*CLI, "daemon", "--cloud", "none", "--socket", sock, "--log-level", "debug"],
                            stdout=None if closed else out, stderr=None if closed else out, env=env, cwd=REPO,
                            preexec_fn=_close_stdout_and_stderr if closed else None)


def _wait_serving(sock: str, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        assert proc.poll() is None, f"daemon exited {proc.returncode}"
        try:
            query_status(sock, timeout=1)
            return
        except OSError:
            time.sleep(0.05)  # a child binding its socket: nothing to await
    raise AssertionError("daemon did not serve")


@pytest.mark.parametrize("stream", ["closed-pipe", "dev-full", "closed-fds"])
async def test_a_failing_log_stream_never_stops_a_notice(sockdir: str, stream: str) -> None:
    sock = os.path.join(sockdir, "l.sock")
    if stream == "dev-full":
        out: Any = open("/dev/full", "wb")  # noqa: SIM115 - handed to the child
        expected = "ENOSPC"
    elif stream == "closed-fds":
        out, expected = None, "dropped"  # no stream to write to: every line dropped, counted
    else:
        r, w = os.pipe()
        os.close(r)  # nobody will ever read: every write is EPIPE
        out, expected = w, "EPIPE"
    proc = _daemon_with_output(sock, out)
    if stream == "dev-full":
        out.close()
    elif out is not None:
        os.close(out)
    try:
        _wait_serving(sock, proc)
        async with Subscription(sock, rank=0) as sub:
            for _ in range(3):
                notice_id = drill(sock)
                assert (await sub.next_notice(timeout=10)).id == notice_id
            state = await sub.status()
        assert state["log_write_errors"].get(expected, 0) > 0, state["log_write_errors"]
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0


# --- spotguard wait-checkpoint --------------------------------------------------------------


def wait_cli(sock: str, timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "wait-checkpoint", "--socket", sock, "--timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen[str]) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err, time.monotonic() - t0


@pytest.mark.serial
async def test_wait_checkpoint_returns_at_once_without_notice_and_waits_for_every_report(sockdir: str) -> None:
    sock = os.path.join(sockdir, "w.sock")
    d = start_daemon(sock)
    try:
        async with Subscription(sock, rank=0) as a, Subscription(sock, rank=1) as b:
            t0 = time.monotonic()
            rc, out, _, _ = finish(wait_cli(sock, 30))
            assert rc == 0 and "none" in out and time.monotonic() - t0 < 5  # nothing active: at once
            notice_id = drill(sock)
            for s in (a, b):
                assert (await s.next_notice(timeout=10)).id == notice_id
            await a.checkpoint_done(notice_id, step=5)
            await a.status()
            # Rank 1 has not reported: the wait times out and names it.
            rc, _, err, _ = finish(wait_cli(sock, 0.5))
            assert rc == 3 and "rank 1" in err and notice_id in err, err
            # A preStop hook blocked on the wait is released by the last report.
            waiting = wait_cli(sock, 30)
            await b.checkpoint_failed(notice_id, "disk full")
            await b.status()
            rc, out, _, took = finish(waiting)
            assert rc == 0 and notice_id in out and took < 10, (rc, out, took)
    finally:
        d.stop()


@pytest.mark.serial
async def test_wait_checkpoint_does_not_wait_for_a_far_notice_until_its_checkpoint_starts(sockdir: str) -> None:
    """A GPU host maintenance an hour out: trainers keep training, so a preStop is not held for it."""
    sock = os.path.join(sockdir, "f.sock")
    d = start_daemon(sock)
    try:
        async with Subscription(sock, rank=0) as a:
            notice_id = drill(sock, kind="termination", deadline_in=3600)
            assert (await a.next_notice(timeout=10)).id == notice_id
            rc, _, _, took = finish(wait_cli(sock, 30))
            assert rc == 0 and took < 10
            await a.checkpoint_started(notice_id, step=9)  # the lead time came: now it is written
            await a.status()
            rc, _, err, _ = finish(wait_cli(sock, 0.5))
            assert rc == 3 and notice_id in err
    finally:
        d.stop()


def test_wait_checkpoint_without_daemon_says_so(sockdir: str) -> None:
    rc, _, err, _ = finish(wait_cli(os.path.join(sockdir, "none.sock"), 1))
    assert rc == 1 and "no spotguard daemon" in err
