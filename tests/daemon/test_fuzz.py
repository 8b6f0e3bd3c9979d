"""Property-based: any malformed or oversized line disconnects only its sender.

One daemon runs in a background thread for the whole module; each example uses
plain blocking sockets, and a long-lived subscriber must keep receiving notices.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotguard.daemon.app import Daemon
from spotguard.protocol import MAX_LINE, ProtocolError, decode

from .conftest import running_daemon, short_dir


class DaemonThread:
    def __init__(self, path: str) -> None:
        self.path = path
        self.ready = threading.Event()
        self.daemon: Daemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with running_daemon(self.path) as d:
                self.daemon = d
                self.ready.set()
                await self._stop.wait()

        try:
            asyncio.run(run())
        except BaseException as exc:  # surfaced by the fixture
            self.error = exc
            self.ready.set()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(10) and self.error is None, self.error

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


class LineReader:
    """Blocking newline-delimited JSON reader over a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def read_type(self, *types: str) -> dict:
        while True:
            msg = self.read()
            if msg["type"] in types:
                return msg


def open_client(path: str) -> tuple[socket.socket, LineReader]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    r = LineReader(s)
    assert r.read()["type"] == "hello"
    return s, r


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[DaemonThread, socket.socket, LineReader]]:
    d = short_dir()
    dt = DaemonThread(os.path.join(d, "fz.sock"))
    dt.start()
    sub, reader = open_client(dt.path)
    sub.sendall(b'{"type":"subscribe","pid":1}\n{"type":"status"}\n')
    assert reader.read_type("status")["type"] == "status"
    try:
        yield dt, sub, reader
    finally:
        sub.close()
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def assert_disconnected(s: socket.socket, r: LineReader) -> None:
    """The daemon closes the offender: reads end in EOF (or reset), never hang."""
    with pytest.raises((EOFError, ConnectionResetError)):
        while True:
            r.read()


def assert_subscriber_still_served(dt: DaemonThread, sub_reader: LineReader) -> None:
    s, r = open_client(dt.path)
    try:
        s.sendall(b'{"type":"drill","kind":"rebalance","deadline_in":600}\n')
        nid = r.read_type("drill_ok", "error")["id"]
    finally:
        s.close()
    assert sub_reader.read_type("notice")["id"] == nid


def is_malformed(line: bytes) -> bool:
    try:
        decode(line)
    except ProtocolError:
        return True
    return False


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
garbage_lines = st.one_of(
    st.binary(min_size=0, max_size=300),
    st.text(max_size=200).map(str.encode),
    st.recursive(json_scalars, lambda c: st.lists(c, max_size=4), max_leaves=10).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"type": st.sampled_from(["ack", "checkpoint_done", "drill", "subscribe"])},
                          optional={"id": json_scalars, "step": json_scalars, "kind": json_scalars,
                                    "deadline_in": json_scalars, "pid": json_scalars}).map(
        lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=5), json_scalars, max_size=3).map(lambda v: json.dumps(v).encode()),
).map(lambda b: b.replace(b"\n", b" ")).filter(lambda b: is_malformed(b + b"\n"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(line=garbage_lines)
def test_garbage_line_disconnects_only_the_sender(live, line: bytes) -> None:
    dt, sub, sub_reader = live
    s, r = open_client(dt.path)
    try:
        s.sendall(b'{"type":"status"}\n' + line + b"\n")
        assert r.read_type("status")["type"] == "status"  # valid lines before it were served
        assert_disconnected(s, r)
    finally:
        s.close()
    assert_subscriber_still_served(dt, sub_reader)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(size=st.integers(min_value=MAX_LINE + 1, max_value=4 * MAX_LINE), newline=st.booleans(),
       fill=st.sampled_from([b"a", b"{", b"\xff", b" "]))
def test_oversized_line_disconnects_only_the_sender(live, size: int, newline: bool, fill: bytes) -> None:
    dt, sub, sub_reader = live
    s, r = open_client(dt.path)
    try:
        try:
            s.sendall(fill * size + (b"\n" if newline else b""))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may close before the whole line is sent
        assert_disconnected(s, r)
    finally:
        s.close()
    assert_subscriber_still_served(dt, sub_reader)
