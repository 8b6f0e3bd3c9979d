"""sd_notify: READY after the socket listens, WATCHDOG at half WATCHDOG_USEC, STOPPING, STATUS."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

from spotguard.daemon.sdnotify import SdNotifier

from .conftest import running_daemon


def test_disabled_without_notify_socket() -> None:
    n = SdNotifier(env={})
    assert not n.enabled and n.watchdog_interval is None
    assert n.ready() is False


def test_path_socket(sockdir: str) -> None:
    path = os.path.join(sockdir, "notify")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(5)
    n = SdNotifier(env={"NOTIFY_SOCKET": path})
    assert n.ready("listening")
    msg = rx.recv(4096).decode().splitlines()
    assert "READY=1" in msg and "STATUS=listening" in msg and f"MAINPID={os.getpid()}" in msg
    assert n.watchdog() and rx.recv(4096) == b"WATCHDOG=1"
    n.close()
    rx.close()


def test_abstract_socket() -> None:
    name = f"spotguard-test-{uuid.uuid4().hex}"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind("\0" + name)
    rx.settimeout(5)
    n = SdNotifier(env={"NOTIFY_SOCKET": "@" + name})
    assert n.stopping("bye")
    assert rx.recv(4096).decode().splitlines() == ["STOPPING=1", "STATUS=bye"]
    n.close()
    rx.close()


def test_unreachable_socket_never_raises(sockdir: str) -> None:
    n = SdNotifier(env={"NOTIFY_SOCKET": os.path.join(sockdir, "nobody-here")})
    assert n.ready() is False and n.watchdog() is False


def test_watchdog_interval() -> None:
    assert SdNotifier(env={"WATCHDOG_USEC": "20000000"}).watchdog_interval == 10.0
    assert SdNotifier(env={"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}).watchdog_interval is None \
        or os.getpid() == 1
    assert SdNotifier(env={"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 0.5
    assert SdNotifier(env={"WATCHDOG_USEC": "junk"}).watchdog_interval is None


async def test_daemon_sends_ready_watchdog_stopping(sockdir: str) -> None:
    path = os.path.join(sockdir, "notify")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.setblocking(False)
    loop = asyncio.get_running_loop()
    notifier = SdNotifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    sock_path = os.path.join(sockdir, "d.sock")

    async def recv_until(key: str) -> list[str]:
        seen = []
        while True:
            data = (await asyncio.wait_for(loop.sock_recv(rx, 4096), 5)).decode()
            seen.append(data)
            if key in data:
                return seen

    async with running_daemon(sock_path, notifier=notifier):
        first = await recv_until("READY=1")
        assert os.path.exists(sock_path)  # READY only once the socket listens
        ready = next(d for d in first if "READY=1" in d)
        assert "STATUS=cloud=none" in ready
        await recv_until("WATCHDOG=1")
        await recv_until("WATCHDOG=1")  # repeated, every 50 ms
    await recv_until("STOPPING=1")
    rx.close()
