"""Socket protocol v1: one dataclass per message type, shared by daemon, hook and CLI.

Newline-delimited UTF-8 JSON objects, each with ``"type"``; at most 64 KiB a line
(docs/architecture.md; README "Run the daemon"). ``decode`` validates field types so that a bad line
is a ``ProtocolError`` naming the problem, never a crash further in.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Union

from .notice import Notice

__all__ = [
    "VERSION",
    "MAX_LINE",
    "DEFAULT_SOCKET",
    "ProtocolError",
    "Message",
    "Hello",
    "NoticeMsg",
    "CancelMsg",
    "Ping",
    "StatusReply",
    "DrillOk",
    "ErrorReply",
    "Subscribe",
    "pod_identity",
    "Ack",
    "CheckpointStarted",
    "CheckpointDone",
    "CheckpointFailed",
    "Drill",
    "DrillCancel",
    "StatusRequest",
    "Unknown",
    "encode",
    "decode",
]

VERSION = 1
MAX_LINE = 64 * 1024
DEFAULT_SOCKET = "/run/spotguard/spotguard.sock"


class ProtocolError(ValueError):
    """A line that is not a valid v1 message."""


@dataclass
class Message:
    type: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}


# --- daemon -> client -------------------------------------------------------


@dataclass
class Hello(Message):
    type: ClassVar[str] = "hello"
    version: int = VERSION
    node: str = ""
    cloud: str = "none"
    sources: list = field(default_factory=list)


@dataclass
class NoticeMsg(Message):
    """A notice; on the wire the record's fields sit at top level beside ``type``."""

    type: ClassVar[str] = "notice"
    notice: Notice = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.notice.to_wire()}


@dataclass
class CancelMsg(Message):
    type: ClassVar[str] = "cancel"
    id: str = ""


@dataclass
class Ping(Message):
    type: ClassVar[str] = "ping"


@dataclass
class StatusReply(Message):
    type: ClassVar[str] = "status"
    state: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.state}


@dataclass
class DrillOk(Message):
    type: ClassVar[str] = "drill_ok"
    id: str = ""
    deadline: str = ""


@dataclass
class ErrorReply(Message):
    type: ClassVar[str] = "error"
    error: str = ""


# --- client -> daemon -------------------------------------------------------


@dataclass
class Subscribe(Message):
    type: ClassVar[str] = "subscribe"
    pid: int = 0
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    job: str = ""
    # Optional (added later, forward compatible: older daemons ignore them): the trainer's
    # Kubernetes pod, from the downward API, for the daemon's Events (--kubernetes-node-actions).
    pod: str = ""
    namespace: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for key in ("pod", "namespace"):  # outside Kubernetes the line stays exactly v1's
            if not d[key]:
                del d[key]
        return d


def pod_identity(env: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """The trainer's pod name and namespace from the downward API env (``SPOTGUARD_POD_NAME`` /
    ``SPOTGUARD_POD_NAMESPACE``, else ``POD_NAME`` / ``POD_NAMESPACE``); ``("", "")`` outside Kubernetes."""
    import os

    env = os.environ if env is None else env
    name = env.get("SPOTGUARD_POD_NAME") or env.get("POD_NAME") or ""
    namespace = env.get("SPOTGUARD_POD_NAMESPACE") or env.get("POD_NAMESPACE") or ""
    return name.strip()[:253], namespace.strip()[:63]


@dataclass
class Ack(Message):
    type: ClassVar[str] = "ack"
    id: str = ""


@dataclass
class CheckpointStarted(Message):
    type: ClassVar[str] = "checkpoint_started"
    id: str = ""
    step: int = 0


@dataclass
class CheckpointDone(Message):
    type: ClassVar[str] = "checkpoint_done"
    id: str = ""
    step: int = 0
    uri: str = ""
    bytes: int = 0
    seconds: float = 0.0
    late: bool = False  # committed after the notice's deadline: it would not have survived a real notice
    seconds_past: float = 0.0  # how far past the deadline (0 when not late)
    rank_bytes: int = 0  # what this rank wrote (notice-aware planning: a doomed rank writes only its own state)
    doomed: bool = False  # this rank held the notice; the replicated state was written by the others
    safe_seconds: float = 0.0  # a doomed rank: seconds from the save's start until its own bytes were durable
    evacuated_bytes: int = 0  # a doomed rank: its unique shards a survivor received and wrote for it
    evacuated_to: int = -1  # ... that survivor's rank (-1: none)


@dataclass
class CheckpointFailed(Message):
    type: ClassVar[str] = "checkpoint_failed"
    id: str = ""
    error: str = ""


@dataclass
class Drill(Message):
    type: ClassVar[str] = "drill"
    kind: str = "preemption"
    deadline_in: float = 30.0


@dataclass
class DrillCancel(Message):
    """Withdraw a drill by id (``spotguard drill --cancel ID``): subscribers get a ``cancel``; reply ``drill_ok``."""

    type: ClassVar[str] = "drill_cancel"
    id: str = ""


@dataclass
class StatusRequest(Message):
    type: ClassVar[str] = "status"


@dataclass
class Unknown(Message):
    """A type this version does not know: ignored, for forward compatibility."""

    type: ClassVar[str] = "unknown"
    name: str = ""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


AnyMessage = Union[
    Hello, NoticeMsg, CancelMsg, Ping, StatusReply, DrillOk, ErrorReply,
    Subscribe, Ack, CheckpointStarted, CheckpointDone, CheckpointFailed, Drill, DrillCancel,
    StatusRequest, Unknown,
]

# "status" names both the request (client->daemon) and the reply (daemon->client).
_FROM_CLIENT: dict[str, type[Message]] = {
    m.type: m
    for m in (Subscribe, Ack, CheckpointStarted, CheckpointDone, CheckpointFailed, Drill, DrillCancel, StatusRequest)
}
_FROM_DAEMON: dict[str, type[Message]] = {
    m.type: m for m in (Hello, NoticeMsg, CancelMsg, Ping, StatusReply, DrillOk, ErrorReply)
}


def encode(msg: Message) -> bytes:
    line = json.dumps(msg.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if len(line) + 1 > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {MAX_LINE}-byte line limit")
    return line + b"\n"


def _check(cls: type[Message], name: str, value: Any) -> Any:
    expected = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    exp = expected if isinstance(expected, str) else getattr(expected, "__name__", str(expected))
    if exp == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{cls.type}.{name} must be an integer, got {type(value).__name__}")
        return value
    if exp == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(f"{cls.type}.{name} must be a finite number")
        return float(value)
    if exp == "str":
        if not isinstance(value, str):
            raise ProtocolError(f"{cls.type}.{name} must be a string, got {type(value).__name__}")
        return value
    if exp == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(f"{cls.type}.{name} must be true or false, got {type(value).__name__}")
        return value
    if exp == "list":
        if not isinstance(value, list):
            raise ProtocolError(f"{cls.type}.{name} must be a list")
        return value
    if exp == "dict":
        if not isinstance(value, dict):
            raise ProtocolError(f"{cls.type}.{name} must be an object")
        return value
    return value


def _build(cls: type[Message], data: Mapping[str, Any]) -> Message:
    if cls is NoticeMsg:
        try:
            return NoticeMsg(notice=Notice.from_wire(data))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"bad notice: {exc}") from None
    if cls is StatusReply:
        return StatusReply(state={k: v for k, v in data.items() if k != "type"})
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _check(cls, f.name, data[f.name])
    return cls(**kwargs)


def decode(line: Union[bytes, str], *, from_daemon: bool = False) -> Message:
    """Parse one line. ``from_daemon`` selects the daemon->client vocabulary."""
    if isinstance(line, bytes):
        if len(line) > MAX_LINE:
            raise ProtocolError(f"line of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"line is not UTF-8: {exc.reason} at byte {exc.start}") from None
    else:
        text = line
    text = text.strip()
    if not text:
        raise ProtocolError("empty line")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"line is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"line must be a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError('message has no string "type" field')
    table = _FROM_DAEMON if from_daemon else _FROM_CLIENT
    cls = table.get(kind)
    if cls is None:
        return Unknown(name=kind, data=data)
    return _build(cls, data)
