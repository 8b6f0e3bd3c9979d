"""Shared helpers for the daemon tests: short socket dirs, a controllable watcher,
an in-process daemon, and a real daemon subprocess that reports READY via sd_notify."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, AsyncIterator, Callable, Iterator, Optional

import pytest

from spotguard.daemon.app import Daemon
from spotguard.daemon.config import DaemonConfig
from spotguard.daemon.sdnotify import SdNotifier
from spotguard.daemon.watchers.base import Watcher
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def short_dir() -> str:
    """AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    return tempfile.mkdtemp(prefix="sg", dir="/tmp")


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = short_dir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sock_path(sockdir: str) -> str:
    return os.path.join(sockdir, "sg.sock")


def make_notice(nid: str = "aws-test-1", *, source: str = "aws", kind: str = "preemption", in_seconds: float = 120,
                detail: str = "") -> Notice:
    now = utcnow()
    return Notice(id=nid, source=source, kind=kind, deadline=now + timedelta(seconds=in_seconds), received_at=now,
                  detail=detail)


class FakeWatcher(Watcher):
    """A watcher the test drives: ``await push(event)`` returns once the daemon ingested it."""

    source = "aws"

    def __init__(self, source: str = "aws", *, crashes: int = 0) -> None:
        self.source = source  # type: ignore[misc]
        super().__init__()
        self.queue: asyncio.Queue[tuple[Any, asyncio.Future[None]]] = asyncio.Queue()
        self.crashes_left = crashes
        self.calls = 0
        self.approved: list[Notice] = []
        self.approve_event = asyncio.Event()
        self.closed = False
        self.node: Optional[str] = None

    async def push(self, event: Any, timeout: float = 5.0) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self.queue.put((event, fut))
        await asyncio.wait_for(fut, timeout)

    def push_nowait(self, event: Any) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((event, fut))
        return fut

    async def events(self) -> AsyncIterator[Any]:
        self.calls += 1
        if self.crashes_left > 0:
            self.crashes_left -= 1
            self.health.error("boom", "test crash")
            raise RuntimeError(f"watcher crash #{self.calls}")
        while True:
            event, fut = await self.queue.get()
            self.health.ok()
            yield event  # resumes only after the daemon ingested the event
            if not fut.done():
                fut.set_result(None)

    async def approve(self, notice: Notice) -> None:
        self.approved.append(notice)
        self.approve_event.set()

    async def close(self) -> None:
        self.closed = True


def make_config(sock: str, **kw: Any) -> DaemonConfig:
    kw.setdefault("cloud", "none")
    kw.setdefault("node", "test-node")
    return DaemonConfig(socket=sock, **kw).validate(create_socket_dir=False)


@contextlib.asynccontextmanager
async def running_daemon(sock: str, watchers: Optional[list[Watcher]] = None, *,
                         notifier: Optional[SdNotifier] = None, **kw: Any) -> AsyncIterator[Daemon]:
    """An in-process daemon (no signal handlers) on ``sock``; stopped on exit."""
    daemon_kw = {k: kw.pop(k) for k in ("restart_backoff", "expire_margin", "housekeeping_interval", "write_timeout",
                                        "metrics") if k in kw}
    daemon_kw.setdefault("restart_backoff", (0.01, 0.05))
    # Every daemon life waits --reconnect-grace before deciding no_subscribers (10 s by default): short here,
    # except in the tests about that wait, which set it themselves.
    kw.setdefault("reconnect_grace", 0.3)
    d = Daemon(make_config(sock, **kw), watchers=watchers or [], install_signals=False,
               notifier=notifier if notifier is not None else SdNotifier(env={}), **daemon_kw)
    task = asyncio.create_task(d.run())
    ready = asyncio.create_task(d.ready.wait())
    await asyncio.wait({task, ready}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raises the start-up error
    assert d.ready.is_set(), "daemon did not become ready"
    try:
        yield d
    finally:
        d.request_stop()
        await asyncio.wait_for(task, 10)


async def eventually(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """For the few states with no event to await (e.g. a drop decided by a timer)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# --- subprocess daemon ---------------------------------------------------------


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    sock: str
    notify: socket.socket
    notify_lines: list[str] = field(default_factory=list)

    def wait_notify(self, key: str, timeout: float = 10.0) -> str:
        """Block until an sd_notify datagram contains ``key`` (e.g. READY=1)."""
        end = time.monotonic() + timeout
        for line in self.notify_lines:
            if key in line:
                return line
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} from the daemon; stderr: {self.stderr_now()}")
            self.notify.settimeout(left)
            try:
                data = self.notify.recv(4096).decode()
            except socket.timeout:
                continue
            self.notify_lines.append(data)
            if key in data:
                return data

    log_path: str = ""

    def stderr_now(self) -> str:
        """The daemon's stderr (its log) so far; a file, so a chatty daemon never blocks on a pipe."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stderr_now().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def stop(self) -> None:
        stop_process(self.proc)
        self.notify.close()


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGINT (the daemon's clean shutdown), SIGKILL if it is still running 10 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def daemon_cmd(*args: str) -> list[str]:
    """The real entry point (``spotguard daemon``), as systemd would run it."""
    return [sys.executable, "-m", "spotguard", "daemon", *args]


@pytest.fixture
def spawn_daemon(sockdir: str) -> Iterator[Callable[..., DaemonProc]]:
    """Start ``spotguard daemon --cloud none`` as a real process; waits for READY=1."""
    procs: list[DaemonProc] = []

    def _spawn(*extra: str, env: Optional[dict[str, str]] = None, sock: Optional[str] = None,
               wait_ready: bool = True) -> DaemonProc:
        path = sock or os.path.join(sockdir, f"d{len(procs)}.sock")
        nsock_path = os.path.join(sockdir, f"n{len(procs)}.sock")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(nsock_path)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        full_env.update({"NOTIFY_SOCKET": nsock_path, "PYTHONUNBUFFERED": "1"})
        full_env.update(env or {})
        log_path = os.path.join(sockdir, f"d{len(procs)}.log")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                daemon_cmd("--cloud", "none", "--socket", path, "--log-format", "json", *extra),
                env=full_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
            )
        dp = DaemonProc(proc, path, notify, log_path=log_path)
        procs.append(dp)
        if wait_ready:
            dp.wait_notify("READY=1")
        return dp

    yield _spawn
    for dp in procs:
        dp.stop()
