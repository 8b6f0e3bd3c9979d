"""The fan-out server over real Unix sockets: protocol v1, isolation of bad/slow clients, socket safety."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import structlog

from spotguard.daemon.app import StartupError
from spotguard.daemon.client import Subscription, connect, read_message, request, send
from spotguard.daemon.server import (
    PeerCred,
    UnsafeSocketPath,
    drill_allowed,
    peer_credentials,
    prepare_socket_path,
)
from spotguard.notice import Cancel
from spotguard.protocol import (
    MAX_LINE,
    CancelMsg,
    Drill,
    DrillOk,
    Hello,
    NoticeMsg,
    Ping,
    StatusReply,
    StatusRequest,
)

from .conftest import FakeWatcher, eventually, make_notice, running_daemon


async def test_hello_on_connect(sock_path: str) -> None:
    async with running_daemon(sock_path, node="n1"):
        reader, writer = await connect(sock_path)
        hello = await read_message(reader, timeout=5)
        assert isinstance(hello, Hello)
        assert hello.version == 1 and hello.node == "n1" and hello.cloud == "none"
        assert {"signal", "drill"} <= set(hello.sources)
        writer.close()


async def test_socket_is_0660_and_removed_on_stop(sock_path: str) -> None:
    async with running_daemon(sock_path):
        st = os.lstat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
    assert not os.path.exists(sock_path)


@pytest.mark.serial
async def test_fifty_subscribers_receive_one_notice(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w]) as d:
        subs = [await Subscription(sock_path, rank=i, world_size=50).open() for i in range(50)]
        assert len(d.server.subscribers()) == 50
        notice = make_notice("aws-fifty")
        t0 = time.monotonic()
        await w.push(notice)
        got = await asyncio.gather(*(s.next_notice(timeout=5) for s in subs))
        elapsed = time.monotonic() - t0
        assert all(n.id == "aws-fifty" and n.kind == "preemption" for n in got)
        assert elapsed < 2.0
        await eventually(lambda: d.metrics.delivery_latency._sum.get() > 0 and
                         d.book.get("aws-fifty").pending == set(), what="all writes completed")
        entry = d.book.get("aws-fifty")
        assert len(entry.latencies) == 50 and max(entry.latencies) < 2.0
        for s in subs:
            await s.close()


async def test_same_notice_yielded_100_times_is_sent_once(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w]) as d:
        sub = await Subscription(sock_path).open()
        notice = make_notice("aws-dup")
        for _ in range(100):
            # Same id, as a re-poll would give (received_at differs each poll).
            await w.push(make_notice("aws-dup"))
        await w.push(make_notice("aws-marker", kind="rebalance"))
        first = await sub.next(timeout=5)
        second = await sub.next(timeout=5)
        assert isinstance(first, NoticeMsg) and first.notice.id == notice.id
        assert isinstance(second, NoticeMsg) and second.notice.id == "aws-marker"
        assert d.book.total == 2
        assert d.metrics.notices.labels("aws", "preemption")._value.get() == 1
        await sub.close()


async def test_late_subscriber_gets_active_notice_replayed(sock_path: str) -> None:
    w = FakeWatcher("gcp")
    async with running_daemon(sock_path, [w]):
        await w.push(make_notice("gcp-early", source="gcp"))
        sub = await Subscription(sock_path).open()
        n = await sub.next_notice(timeout=5)
        assert n.id == "gcp-early" and n.source == "gcp"
        # Then live ones, and the replayed one is not sent twice.
        await w.push(make_notice("gcp-early", source="gcp"))
        await w.push(make_notice("gcp-live", source="gcp"))
        assert (await sub.next_notice(timeout=5)).id == "gcp-live"
        await sub.close()


async def test_cancel_is_delivered_and_notice_leaves_active(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w]) as d:
        sub = await Subscription(sock_path).open()
        await w.push(make_notice("aws-evt", kind="maintenance"))
        assert (await sub.next_notice(timeout=5)).id == "aws-evt"
        await w.push(Cancel(id="aws-evt", source="aws", detail="canceled"))
        msg = await sub.next(timeout=5)
        assert isinstance(msg, CancelMsg) and msg.id == "aws-evt"
        assert d.book.get("aws-evt") is None
        # Cancelling again (next poll) sends nothing; a late subscriber gets no replay.
        await w.push(Cancel(id="aws-evt", source="aws"))
        late = await Subscription(sock_path).open()
        state = await late.status()
        assert state["active_notices"] == []
        await sub.close()
        await late.close()


async def test_unsubscribed_client_gets_no_notices(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w]):
        reader, writer = await connect(sock_path)
        assert isinstance(await read_message(reader, timeout=5), Hello)
        await w.push(make_notice("aws-x"))
        await send(writer, StatusRequest())
        reply = await read_message(reader, timeout=5)
        assert isinstance(reply, StatusReply)  # no notice queued before it
        writer.close()


def never_reading_client(sock_path: str, lines: bytes) -> socket.socket:
    """A raw client with a small receive buffer that sends ``lines`` and then never reads."""
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(sock_path)
    slow.sendall(lines)
    return slow


@pytest.mark.serial
async def test_slow_reader_does_not_stall_others_and_is_dropped(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w], send_queue=16) as d:
        slow = never_reading_client(sock_path, b'{"type":"subscribe","pid":1,"rank":9}\n{"type":"status"}\n')
        good = [await Subscription(sock_path, rank=i).open() for i in range(3)]
        await eventually(lambda: len(d.server.subscribers()) == 4, what="4 subscribers")

        count, big = 200, "x" * 40_000  # ~8 MB in all: far more than any socket buffer
        received: list[list[float]] = [[] for _ in good]

        async def reader(i: int) -> None:
            for _ in range(count):
                n = await good[i].next_notice(timeout=10)
                received[i].append((time.time() - n.received_at.timestamp()))

        readers = [asyncio.create_task(reader(i)) for i in range(len(good))]
        t0 = time.monotonic()
        for k in range(count):
            await w.push(make_notice(f"aws-big-{k}", detail=big))
        await asyncio.wait_for(asyncio.gather(*readers), 20)
        elapsed = time.monotonic() - t0
        assert all(len(r) == count for r in received)
        assert elapsed < 10, f"good subscribers took {elapsed:.2f}s"
        # The slow one was dropped by queue overflow, with a counted reason.
        assert len(d.server.subscribers()) == 3
        assert d.metrics.disconnects.labels("slow_reader")._value.get() == 1
        # Its socket ends (EOF or reset) once what the kernel buffered is read.
        slow.settimeout(5)
        try:
            while slow.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
        slow.close()
        for g in good:
            await g.close()


async def test_write_stall_drops_client(sock_path: str) -> None:
    """A reader that stops without overflowing the queue is dropped by the write timeout."""
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w], write_timeout=0.3) as d:
        slow = never_reading_client(sock_path, b'{"type":"subscribe"}\n')
        await eventually(lambda: len(d.server.subscribers()) == 1, what="subscriber")
        for k in range(10):  # 10 x 60 KB: more than the socket buffers, fewer than the queue
            await w.push(make_notice(f"aws-s{k}", detail="y" * 60_000))
        await eventually(lambda: not d.server.subscribers(), timeout=5, what="stalled client dropped")
        assert d.metrics.disconnects.labels("slow_reader")._value.get() == 1
        slow.close()


async def test_max_subscribers(sock_path: str) -> None:
    async with running_daemon(sock_path, max_subscribers=2) as d:
        a = await Subscription(sock_path).open()
        b = await Subscription(sock_path).open()
        with pytest.raises(ConnectionError, match="too many subscribers"):
            await Subscription(sock_path).open()
        assert len(d.server.subscribers()) == 2
        await a.close()
        await eventually(lambda: len(d.server.subscribers()) == 1, what="a gone")
        c = await Subscription(sock_path).open()  # room again
        await b.close()
        await c.close()


async def test_ping_is_sent(sock_path: str) -> None:
    async with running_daemon(sock_path, ping_interval=0.05):
        reader, writer = await connect(sock_path)
        assert isinstance(await read_message(reader, timeout=5), Hello)
        assert isinstance(await read_message(reader, timeout=5), Ping)
        writer.close()


async def test_unknown_types_ignored_and_max_line_accepted(sock_path: str) -> None:
    async with running_daemon(sock_path):
        reader, writer = await connect(sock_path)
        await read_message(reader, timeout=5)
        writer.write(b'{"type":"from_the_future","x":1}\n')
        head = b'{"type":"padding","pad":"'
        tail = b'"}\n'
        line = head + b"a" * (MAX_LINE - len(head) - len(tail)) + tail
        assert len(line) == MAX_LINE
        writer.write(line)
        await send(writer, StatusRequest())
        assert isinstance(await read_message(reader, timeout=5), StatusReply)
        writer.close()


@pytest.mark.parametrize("payload, reason", [
    (b"not json\n", "not JSON"),
    (b"\xff\xfe\n", "not UTF-8"),
    (b"[1,2]\n", "JSON object"),
    (b'{"type":"ack","id":5}\n', "must be a string"),
    (b"a" * (MAX_LINE + 10), "longer than"),
])
async def test_malformed_line_closes_only_that_client(sock_path: str, payload: bytes, reason: str) -> None:
    with structlog.testing.capture_logs() as logs:
        await _malformed_case(sock_path, payload)
    drops = [r for r in logs if r["event"] == "client.dropped"]
    assert len(drops) == 1 and reason in drops[0]["reason"] and "malformed" in drops[0]["reason"]
    assert drops[0]["peer_pid"] == os.getpid()


async def _malformed_case(sock_path: str, payload: bytes) -> None:
    async with running_daemon(sock_path) as d:
        good = await Subscription(sock_path).open()
        reader, writer = await connect(sock_path)
        await read_message(reader, timeout=5)
        writer.write(payload)
        with pytest.raises((EOFError, ConnectionResetError)):
            while True:
                await read_message(reader, timeout=5)
        # The other client is unaffected and still gets notices.
        reply = await request(sock_path, Drill(kind="rebalance", deadline_in=60))
        assert isinstance(reply, DrillOk)
        assert (await good.next_notice(timeout=5)).id == reply.id
        assert d.metrics.disconnects.labels("malformed")._value.get() == 1
        await good.close()


def test_prepare_socket_path_refuses_symlink_and_regular_file(sockdir: str) -> None:
    target = os.path.join(sockdir, "target")
    open(target, "w").close()
    link = os.path.join(sockdir, "link.sock")
    os.symlink(target, link)
    with pytest.raises(UnsafeSocketPath, match="symlink"):
        prepare_socket_path(link)
    assert os.path.islink(link) and os.path.exists(target)
    with pytest.raises(UnsafeSocketPath, match="not a socket"):
        prepare_socket_path(target)
    assert os.path.exists(target)


def test_prepare_socket_path_removes_stale_socket(sockdir: str) -> None:
    path = os.path.join(sockdir, "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # file remains, nobody listens: a dead daemon's leftover
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    prepare_socket_path(path)
    assert not os.path.exists(path)


async def test_second_daemon_refuses_live_socket(sock_path: str) -> None:
    async with running_daemon(sock_path):
        with pytest.raises(StartupError, match="already serving"):
            async with running_daemon(sock_path):
                pass
        # The first one still serves.
        assert isinstance(await request(sock_path, StatusRequest()), StatusReply)


async def test_daemon_refuses_symlinked_socket_path(sockdir: str) -> None:
    target = os.path.join(sockdir, "elsewhere")
    open(target, "w").close()
    path = os.path.join(sockdir, "sg.sock")
    os.symlink(target, path)
    with pytest.raises(StartupError, match="symlink"):
        async with running_daemon(path):
            pass
    assert os.path.islink(path)


def test_peer_credentials_of_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cred = peer_credentials(a)
        assert cred == PeerCred(os.getpid(), os.getuid(), os.getgid())
    finally:
        a.close()
        b.close()


def test_drill_allowed_decision() -> None:
    assert drill_allowed(PeerCred(1, 0, 0), daemon_uid=1000)
    assert drill_allowed(PeerCred(1, 1000, 1000), daemon_uid=1000)
    assert not drill_allowed(PeerCred(1, 65534, 65534), daemon_uid=1000)
    assert not drill_allowed(PeerCred(1, 65534, 65534), daemon_uid=0)
    assert not drill_allowed(None, daemon_uid=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
async def test_drill_from_other_uid_is_refused(sockdir: str) -> None:
    """A real client running as nobody (allowed to connect via --socket-group) gets an error reply."""
    os.chmod(sockdir, 0o755)
    path = os.path.join(sockdir, "sg.sock")
    async with running_daemon(path, socket_group="65534") as d:
        sub = await Subscription(path).open()
        st = os.stat(path)
        assert st.st_gid == 65534 and stat.S_IMODE(st.st_mode) == 0o660
        code = textwrap.dedent(f"""
            import os, socket, json
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)
            s.connect({path!r})
            f = s.makefile("rb")
            hello = json.loads(f.readline())
            s.sendall(b'{{"type":"drill","kind":"preemption","deadline_in":30}}\\n')
            while True:
                msg = json.loads(f.readline())
                if msg["type"] != "ping":
                    break
            print(json.dumps({{"hello": hello["type"], "reply": msg}}))
        """)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err.decode()
        result = json.loads(out)
        assert result["hello"] == "hello"
        assert result["reply"]["type"] == "error"
        assert "uid 65534" in result["reply"]["error"] and "refused" in result["reply"]["error"]
        # No notice was injected.
        assert d.book.total == 0 and not d.book.active
        assert (await sub.status())["active_notices"] == []
        await sub.close()
