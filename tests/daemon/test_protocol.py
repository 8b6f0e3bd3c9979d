"""Protocol v1 on the wire, read as raw bytes from a real daemon socket: message shapes,
the notice record's fields at top level, RFC 3339 UTC times with milliseconds and Z."""

from __future__ import annotations

import json
import re
import socket

import pytest

from spotguard.protocol import MAX_LINE, ProtocolError, Subscribe, Unknown, decode, encode

from .conftest import running_daemon

RFC3339_MS_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class Raw:
    """A blocking client reading raw lines (no spotguard client code in the way)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.buf = b""

    def line(self) -> bytes:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "daemon closed the connection"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def next_of(self, *types: str) -> dict:
        while True:
            msg = json.loads(self.line())
            if msg["type"] in types:
                return msg

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")


async def test_wire_shapes_from_a_real_daemon(sock_path: str) -> None:
    import asyncio

    async with running_daemon(sock_path, node="wire-node"):
        def talk() -> tuple[dict, dict, dict, dict]:
            c = Raw(sock_path)
            hello = json.loads(c.line())
            c.send({"type": "subscribe", "pid": 1, "rank": 0, "local_rank": 0, "world_size": 1, "job": "w"})
            c.send({"type": "drill", "kind": "preemption", "deadline_in": 30})
            got: dict[str, dict] = {}
            while not {"drill_ok", "notice"} <= set(got):  # the notice is queued before the reply
                msg = c.next_of("drill_ok", "error", "notice")
                got[msg["type"]] = msg
            drill_ok, notice = got["drill_ok"], got["notice"]
            c.send({"type": "status"})
            status = c.next_of("status")
            c.sock.close()
            return hello, drill_ok, notice, status

        hello, drill_ok, notice, status = await asyncio.to_thread(talk)
    assert hello == {"type": "hello", "version": 1, "node": "wire-node", "cloud": "none",
                     "sources": ["signal", "drill"]}
    assert set(drill_ok) == {"type", "id", "deadline"} and RFC3339_MS_Z.match(drill_ok["deadline"])
    # The record's fields sit at top level beside "type".
    assert set(notice) == {"type", "id", "source", "kind", "deadline", "received_at", "detail"}
    assert (notice["id"], notice["source"], notice["kind"]) == (drill_ok["id"], "drill", "preemption")
    assert RFC3339_MS_Z.match(notice["deadline"]) and RFC3339_MS_Z.match(notice["received_at"])
    assert notice["deadline"] == drill_ok["deadline"]
    assert status["type"] == "status" and status["cloud"] == "none" and status["last_notice"]["id"] == notice["id"]


def test_encode_decode_and_limits() -> None:
    line = encode(Subscribe(pid=7, rank=1, local_rank=1, world_size=2, job="j"))
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert json.loads(line) == {"type": "subscribe", "pid": 7, "rank": 1, "local_rank": 1, "world_size": 2,
                                "job": "j"}
    assert decode(line) == Subscribe(pid=7, rank=1, local_rank=1, world_size=2, job="j")
    future = decode(b'{"type":"resume_hint","x":1}\n')
    assert isinstance(future, Unknown) and future.name == "resume_hint"
    with pytest.raises(ProtocolError):
        decode(b"x" * (MAX_LINE + 1))
    with pytest.raises(ProtocolError):
        encode(Subscribe(job="j" * MAX_LINE))


def test_subscribe_pod_fields_are_optional_and_round_trip() -> None:
    from spotguard.protocol import pod_identity

    line = encode(Subscribe(pid=7, job="j", pod="train-0", namespace="ml"))
    msg = decode(line)
    assert isinstance(msg, Subscribe) and (msg.pod, msg.namespace) == ("train-0", "ml")
    assert decode(b'{"type":"subscribe","pid":1}') == Subscribe(pid=1)  # an older hook: no pod fields
    assert pod_identity({"SPOTGUARD_POD_NAME": "a", "POD_NAME": "b", "POD_NAMESPACE": "ns"}) == ("a", "ns")
    assert pod_identity({}) == ("", "")
