"""NoticeIntake against a real Unix socket server speaking protocol v1 (a stand-in for the daemon)."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest
from structlog.testing import capture_logs

from spotguard import protocol
from spotguard.hook.intake import NoticeIntake
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

WAIT = 10.0  # generous upper bound on any event; tests normally finish in milliseconds


def make_notice(nid: str = "aws-1", kind: str = "preemption") -> Notice:
    return Notice(id=nid, source="aws", kind=kind, deadline=utcnow() + timedelta(seconds=120), detail="{}")


class FakeDaemon:
    """A minimal v1 daemon: hello on connect, records client messages, replays active notices on subscribe."""

    def __init__(self, path: str, *, read_clients: bool = True, garbage_after_hello: bytes | None = None) -> None:
        self.path = path
        self.read_clients = read_clients
        self.garbage_after_hello = garbage_after_hello
        self.active: list[Notice] = []
        self.received: "queue.Queue[protocol.Message]" = queue.Queue()
        self.subscribed = threading.Event()
        self.connections = 0
        self.connected_once = threading.Event()
        self._subscribers: list[socket.socket] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        self._listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                self.connections += 1
                self._conns.append(conn)
            self.connected_once.set()
            try:
                conn.sendall(protocol.encode(protocol.Hello(node="test-node", cloud="aws", sources=["aws"])))
                if self.garbage_after_hello is not None:
                    conn.sendall(self.garbage_after_hello)
            except OSError:  # the client already hung up (it rejected the garbage)
                continue
            if self.read_clients:
                threading.Thread(target=self._read_loop, args=(conn,), daemon=True).start()

    def _read_loop(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            for line in f:
                msg = protocol.decode(line)
                self.received.put(msg)
                if isinstance(msg, protocol.Subscribe):
                    with self._lock:
                        self._subscribers.append(conn)
                        for n in self.active:
                            conn.sendall(protocol.encode(protocol.NoticeMsg(notice=n)))
                    self.subscribed.set()
        except (OSError, ValueError):
            pass

    def push(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.NoticeMsg):
            self.active.append(msg.notice)
        with self._lock:
            for conn in self._subscribers:
                conn.sendall(protocol.encode(msg))

    def expect(self, kind: type, timeout: float = WAIT) -> protocol.Message:
        """The next received message of ``kind`` (others are skipped)."""
        end = time.monotonic() + timeout
        while True:
            msg = self.received.get(timeout=max(0.0, end - time.monotonic()))
            if isinstance(msg, kind):
                return msg

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
        os.unlink(self.path)


@pytest.fixture
def sock_path() -> Iterator[str]:
    d = tempfile.mkdtemp(dir="/tmp", prefix="sg-")
    yield os.path.join(d, "d.sock")
    shutil.rmtree(d, ignore_errors=True)


class Recorder:
    def __init__(self) -> None:
        self.notices: "queue.Queue[Notice]" = queue.Queue()
        self.cancels: "queue.Queue[str]" = queue.Queue()

    def on_notice(self, n: Notice) -> None:
        self.notices.put(n)

    def on_cancel(self, nid: str) -> None:
        self.cancels.put(nid)


def make_intake(path: str | None, rec: Recorder, **kw: object) -> NoticeIntake:
    return NoticeIntake(path, rank=1, local_rank=1, world_size=2, job="job-42",
                        on_notice=rec.on_notice, on_cancel=rec.on_cancel, **kw)  # type: ignore[arg-type]


def test_notice_delivered_acked_and_reports_sent(sock_path: str) -> None:
    server = FakeDaemon(sock_path)
    rec = Recorder()
    intake = make_intake(sock_path, rec)
    try:
        intake.start()
        assert intake.wait_connected(WAIT)
        sub = server.expect(protocol.Subscribe)
        assert (sub.rank, sub.local_rank, sub.world_size, sub.job, sub.pid) == (1, 1, 2, "job-42", os.getpid())
        assert intake.hello is not None and intake.hello.node == "test-node"
        notice = make_notice()
        server.push(protocol.NoticeMsg(notice=notice))
        got = rec.notices.get(timeout=WAIT)
        assert got.id == notice.id and got.kind == "preemption" and abs((got.deadline - notice.deadline).total_seconds()) < 0.001
        assert server.expect(protocol.Ack).id == notice.id
        intake.report(protocol.CheckpointStarted(id=notice.id, step=17))
        intake.report(protocol.CheckpointDone(id=notice.id, step=17, uri="file:///x", bytes=5, seconds=0.5))
        assert server.expect(protocol.CheckpointStarted).step == 17
        assert server.expect(protocol.CheckpointDone).bytes == 5
        server.push(protocol.CancelMsg(id="aws-other"))
        assert rec.cancels.get(timeout=WAIT) == "aws-other"
        server.push(protocol.Ping())  # ignored, connection stays
        assert intake.connected.is_set()
    finally:
        intake.close()
        server.stop()
    assert intake._thread is not None and not intake._thread.is_alive()


def test_reconnects_after_daemon_restart_on_same_path(sock_path: str) -> None:
    rec = Recorder()
    first = FakeDaemon(sock_path)
    intake = make_intake(sock_path, rec, backoff_max=0.2)
    intake.start()
    try:
        assert intake.wait_connected(WAIT)
        first.expect(protocol.Subscribe)
        old = make_notice("aws-old", kind="rebalance")
        first.push(protocol.NoticeMsg(notice=old))
        assert rec.notices.get(timeout=WAIT).id == "aws-old"
        first.stop()

        second = FakeDaemon(sock_path)
        second.active.append(old)  # a restarted daemon replays what is still active
        try:
            assert second.subscribed.wait(WAIT)
            assert second.expect(protocol.Ack).id == "aws-old"  # replay acked ...
            new = make_notice("aws-new")
            second.push(protocol.NoticeMsg(notice=new))
            assert rec.notices.get(timeout=WAIT).id == "aws-new"  # ... but not re-delivered
            assert rec.notices.empty()
            assert intake.connected.is_set()
        finally:
            second.stop()
    finally:
        intake.close()


def test_no_daemon_warns_once_and_keeps_retrying_until_one_appears(sock_path: str) -> None:
    rec = Recorder()
    intake = make_intake(sock_path, rec, backoff_max=0.05)
    attempts = 0
    enough = threading.Event()
    real_connect = intake._connect

    def counting_connect() -> socket.socket:
        nonlocal attempts
        attempts += 1
        if attempts >= 6:
            enough.set()
        return real_connect()

    intake._connect = counting_connect  # type: ignore[method-assign]
    with capture_logs() as logs:
        intake.start()
        try:
            assert enough.wait(WAIT)
            assert not intake.connected.is_set()
            warnings = [e for e in logs if e["log_level"] == "warning"]
            assert len(warnings) == 1, warnings
            assert f"no spotguard daemon at {sock_path}" in warnings[0]["event"]
            assert "SIGTERM/SIGUSR1" in warnings[0]["event"] and "SPOTGUARD_SOCKET" in warnings[0]["event"]
            intake.report(protocol.Ack(id="x"))  # dropped, never raises
            server = FakeDaemon(sock_path)  # the daemon comes up later: picked up quietly
            try:
                assert intake.wait_connected(WAIT)
                assert server.subscribed.wait(WAIT)
            finally:
                server.stop()
        finally:
            intake.close()


def test_socket_path_from_env(monkeypatch: pytest.MonkeyPatch, sock_path: str) -> None:
    monkeypatch.setenv("SPOTGUARD_SOCKET", sock_path)
    assert make_intake(None, Recorder()).socket_path == sock_path
    monkeypatch.delenv("SPOTGUARD_SOCKET")
    assert make_intake(None, Recorder()).socket_path == protocol.DEFAULT_SOCKET


@pytest.mark.serial
def test_report_never_blocks_when_daemon_does_not_read(sock_path: str) -> None:
    server = FakeDaemon(sock_path, read_clients=False)
    rec = Recorder()
    intake = make_intake(sock_path, rec)
    intake.start()
    try:
        assert intake.wait_connected(WAIT)
        big = "e" * 60_000
        t0 = time.monotonic()
        for _ in range(3000):  # ~180 MB: far beyond any socket buffer
            intake.report(protocol.CheckpointFailed(id="aws-1", error=big))
        assert time.monotonic() - t0 < 2.0
        # the intake thread itself is not stuck behind the unsent reports: notices still arrive
        with server._lock:
            server._subscribers.extend(server._conns)
        server.push(protocol.NoticeMsg(notice=make_notice("aws-late")))
        assert rec.notices.get(timeout=WAIT).id == "aws-late"
    finally:
        t0 = time.monotonic()
        intake.close()
        assert time.monotonic() - t0 < 3.0
        server.stop()


@pytest.mark.parametrize(
    "garbage",
    [b"this is not json\n", b'{"type": "notice", "id": "x"}\n', b"x" * (protocol.MAX_LINE + 10)],
    ids=["not-json", "bad-notice", "overlong-line"],
)
def test_malformed_daemon_line_logs_and_reconnects(sock_path: str, garbage: bytes) -> None:
    server = FakeDaemon(sock_path, garbage_after_hello=garbage)
    rec = Recorder()
    intake = make_intake(sock_path, rec, backoff_max=0.05)
    with capture_logs() as logs:
        intake.start()
        try:
            deadline = time.monotonic() + WAIT
            while server.connections < 2 and time.monotonic() < deadline:
                server.connected_once.clear()
                server.connected_once.wait(0.5)
            assert server.connections >= 2  # it came back after dropping the bad connection
        finally:
            intake.close()
            server.stop()
    lost = [e for e in logs if "reconnecting" in e["event"] or "before subscribe" in e["event"]]
    assert lost and any("malformed" in e.get("reason", "") for e in lost)
    assert rec.notices.empty()


def test_callback_exception_does_not_kill_the_intake(sock_path: str) -> None:
    server = FakeDaemon(sock_path)
    got: "queue.Queue[str]" = queue.Queue()

    def on_notice(n: Notice) -> None:
        if n.id == "aws-boom":
            raise RuntimeError("user callback bug")
        got.put(n.id)

    intake = NoticeIntake(sock_path, rank=0, local_rank=0, world_size=1, job="j", on_notice=on_notice)
    intake.start()
    try:
        assert intake.wait_connected(WAIT)
        server.expect(protocol.Subscribe)
        with capture_logs() as logs:
            server.push(protocol.NoticeMsg(notice=make_notice("aws-boom")))
            assert server.expect(protocol.Ack).id == "aws-boom"
            server.push(protocol.NoticeMsg(notice=make_notice("aws-ok")))
            assert got.get(timeout=WAIT) == "aws-ok"
        assert any(e["event"] == "intake callback raised" for e in logs)
        assert intake.connected.is_set()
    finally:
        intake.close()
        server.stop()


def test_flush_returns_true_once_reports_are_on_the_socket(sock_path: str) -> None:
    """flush() is what the hook calls right before exiting: after it, closing must not lose checkpoint_done."""
    server = FakeDaemon(sock_path)
    intake = make_intake(sock_path, Recorder())
    intake.start()
    try:
        assert intake.wait_connected(WAIT)
        server.expect(protocol.Subscribe)
        assert intake.flush(0.0)  # nothing queued: idle at once
        intake.report(protocol.CheckpointStarted(id="aws-1", step=9))
        intake.report(protocol.CheckpointDone(id="aws-1", step=9, uri="file:///ckpt/step-00000009", bytes=123,
                                              seconds=0.25))
        assert intake.flush(WAIT) is True
        intake.close()  # the process exits right after flush: nothing may still sit in the queue
        assert server.expect(protocol.CheckpointStarted).step == 9
        done = server.expect(protocol.CheckpointDone)
        assert (done.id, done.step, done.uri, done.bytes) == ("aws-1", 9, "file:///ckpt/step-00000009", 123)
    finally:
        intake.close()
        server.stop()
