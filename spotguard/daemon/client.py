"""Client side of the socket: ``spotguard status`` / ``spotguard drill`` and a small reusable helper.

The helper (``connect``, ``read_message``, ``send``, ``request``, ``Subscription``)
is what tests, the demo and the benchmarks use to talk to a daemon; the hook has
its own resilient client but speaks the same ``spotguard.protocol`` messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
from typing import Any, AsyncIterator, Optional

from ..notice import KINDS, Notice
from ..protocol import (
    DEFAULT_SOCKET,
    MAX_LINE,
    Ack,
    CheckpointDone,
    CheckpointFailed,
    CheckpointStarted,
    Drill,
    DrillCancel,
    DrillOk,
    ErrorReply,
    Hello,
    Message,
    NoticeMsg,
    Ping,
    StatusReply,
    StatusRequest,
    Subscribe,
    decode,
    encode,
    pod_identity,
)

__all__ = [
    "DaemonUnavailable",
    "default_socket_path",
    "connect",
    "read_message",
    "send",
    "request",
    "request_sync",
    "Subscription",
    "add_status_arguments",
    "status_main",
    "add_drill_arguments",
    "drill_main",
]


class DaemonUnavailable(ConnectionError):
    """Nothing answers on the socket; ``str()`` names the path and how to start the daemon."""


def default_socket_path() -> str:
    return os.environ.get("SPOTGUARD_SOCKET") or DEFAULT_SOCKET


def _unavailable(path: str, why: str) -> DaemonUnavailable:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        # The daemon refuses to replace anything that is not a socket: suggesting
        # `spotguard daemon --socket PATH` would only lead to a second refusal.
        what = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
        return DaemonUnavailable(
            f"{path} is {what}, not the daemon's socket ({why}); point --socket / SPOTGUARD_SOCKET at the "
            f"daemon's socket (default {DEFAULT_SOCKET}), or move {path} away before starting "
            f"`spotguard daemon --socket {path}`"
        )
    return DaemonUnavailable(
        f"no spotguard daemon answering on {path} ({why}); start one with `spotguard daemon --socket {path}` "
        "(or `systemctl start spotguard`), or point --socket / SPOTGUARD_SOCKET at its socket"
    )


async def connect(path: Optional[str] = None, *, timeout: float = 5.0) -> tuple[asyncio.StreamReader,
                                                                               asyncio.StreamWriter]:
    """Open the daemon's socket with a reader bounded to the protocol's line limit."""
    path = path or default_socket_path()
    try:
        return await asyncio.wait_for(asyncio.open_unix_connection(path, limit=MAX_LINE - 1), timeout)
    except asyncio.TimeoutError:
        raise _unavailable(path, f"connect timed out after {timeout:g}s") from None
    except OSError as exc:
        raise _unavailable(path, exc.strerror or str(exc)) from None


async def read_message(reader: asyncio.StreamReader, timeout: Optional[float] = None) -> Message:
    """Next daemon->client message; ``EOFError`` when the daemon closed the connection."""
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout)
    except asyncio.IncompleteReadError:
        raise EOFError("daemon closed the connection") from None
    return decode(line, from_daemon=True)


async def send(writer: asyncio.StreamWriter, msg: Message) -> None:
    writer.write(encode(msg))
    await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def request(path: Optional[str], message: Message, *, timeout: float = 5.0) -> Message:
    """One request, one reply (``status`` -> status, ``drill`` -> drill_ok | error).

    Skips the ``hello`` and any ``ping``/``notice`` that arrive before the reply.
    """
    path = path or default_socket_path()
    reader, writer = await connect(path, timeout=timeout)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        await send(writer, message)
        while True:
            left = end - loop.time()
            if left <= 0:
                raise _unavailable(path, f"no reply within {timeout:g}s")
            try:
                msg = await read_message(reader, timeout=left)
            except asyncio.TimeoutError:
                raise _unavailable(path, f"no reply within {timeout:g}s") from None
            except EOFError:
                raise _unavailable(path, "connection closed before the reply") from None
            if isinstance(msg, (StatusReply, DrillOk, ErrorReply)):
                return msg
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise _unavailable(path, str(exc)) from None
    finally:
        await _close(writer)


def request_sync(path: Optional[str], message: Message, *, timeout: float = 5.0) -> Message:
    """``request`` for synchronous code (CLI, scripts); not for use inside a running loop."""
    return asyncio.run(request(path, message, timeout=timeout))


class Subscription:
    """A subscribed connection: ``async with Subscription(path, rank=0) as sub: async for msg in sub``.

    Iteration yields ``NoticeMsg`` and ``CancelMsg`` (pings are skipped); the
    ``ack``/``checkpoint_*`` methods send the reports the daemon records.
    """

    def __init__(self, path: Optional[str] = None, *, pid: Optional[int] = None, rank: int = 0,
                 local_rank: int = 0, world_size: int = 1, job: str = "", timeout: float = 5.0,
                 pod: Optional[str] = None, namespace: Optional[str] = None) -> None:
        self.path = path or default_socket_path()
        env_pod, env_ns = pod_identity()
        self.subscribe_msg = Subscribe(pid=os.getpid() if pid is None else pid, rank=rank, local_rank=local_rank,
                                       world_size=world_size, job=job, pod=env_pod if pod is None else pod,
                                       namespace=env_ns if namespace is None else namespace)
        self.timeout = timeout
        self.hello: Optional[Hello] = None
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        # Messages read while waiting for a status reply, handed out by ``next`` first.
        self._backlog: list[Message] = []

    async def open(self, *, confirm: bool = True) -> "Subscription":
        """Connect, read ``hello``, subscribe. With ``confirm``, round-trip a ``status``
        so that on return the daemon has registered the subscription (no race with
        a notice sent right after)."""
        self.reader, self.writer = await connect(self.path, timeout=self.timeout)
        msg = await read_message(self.reader, timeout=self.timeout)
        if not isinstance(msg, Hello):
            raise ConnectionError(f"expected hello from the daemon, got {msg.type}")
        self.hello = msg
        await send(self.writer, self.subscribe_msg)
        if confirm:
            await send(self.writer, StatusRequest())
            while True:
                reply = await read_message(self.reader, timeout=self.timeout)
                if isinstance(reply, StatusReply):
                    break
                if isinstance(reply, ErrorReply):
                    raise ConnectionError(f"daemon refused the subscription: {reply.error}")
                if not isinstance(reply, Ping):
                    self._backlog.append(reply)
        return self

    async def __aenter__(self) -> "Subscription":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self.writer is not None:
            await _close(self.writer)
            self.writer = None

    async def next(self, timeout: Optional[float] = None) -> Message:
        """Next notice/cancel (or error); ``EOFError`` when the daemon closed the connection."""
        if self._backlog:
            return self._backlog.pop(0)
        assert self.reader is not None, "call open() first"
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while True:
            left = None if end is None else max(0.0, end - loop.time())
            msg = await read_message(self.reader, timeout=left)
            if not isinstance(msg, Ping):
                return msg

    async def next_notice(self, timeout: Optional[float] = None) -> Notice:
        while True:
            msg = await self.next(timeout)
            if isinstance(msg, NoticeMsg):
                return msg.notice

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.next()
            except EOFError:
                return

    async def _send(self, msg: Message) -> None:
        assert self.writer is not None, "call open() first"
        await send(self.writer, msg)

    async def ack(self, notice_id: str) -> None:
        await self._send(Ack(id=notice_id))

    async def checkpoint_started(self, notice_id: str, step: int) -> None:
        await self._send(CheckpointStarted(id=notice_id, step=step))

    async def checkpoint_done(self, notice_id: str, step: int, uri: str = "", nbytes: int = 0,
                              seconds: float = 0.0, seconds_past: float = 0.0) -> None:
        """``seconds_past`` > 0: committed that long after the notice's deadline (reported ``late``)."""
        await self._send(CheckpointDone(id=notice_id, step=step, uri=uri, bytes=nbytes, seconds=seconds,
                                        late=seconds_past > 0, seconds_past=max(0.0, seconds_past)))

    async def checkpoint_failed(self, notice_id: str, error: str) -> None:
        await self._send(CheckpointFailed(id=notice_id, error=error))

    async def status(self) -> dict[str, Any]:
        """A status round-trip on this connection (notices arriving meanwhile are kept for ``next``)."""
        await self._send(StatusRequest())
        assert self.reader is not None
        while True:
            msg = await read_message(self.reader, timeout=self.timeout)
            if isinstance(msg, StatusReply):
                return msg.state
            if not isinstance(msg, Ping):
                self._backlog.append(msg)


# --- CLI ----------------------------------------------------------------------


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help=f"daemon socket (default: $SPOTGUARD_SOCKET or {DEFAULT_SOCKET})")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="give up after (default 5)")


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--json", action="store_true", help="print the raw status object as JSON")
    parser.add_argument("--check", action="store_true",
                        help="health check: exit 0 only if the daemon serves and every metadata watcher sees "
                             "notices, else print why (with the fix) and exit 1 (readiness, alerts)")
    parser.add_argument("--live", action="store_true",
                        help="liveness probe: exit 0 if the daemon serves its socket (sends its hello), whatever "
                             "its watchers see; stdlib only, about half the memory of --check (spotguard/live.py)")


def add_drill_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--kind", choices=KINDS, default="preemption", help="notice kind (default preemption)")
    parser.add_argument("--deadline-in", type=float, default=30.0, metavar="SECONDS",
                        help="deadline of the synthetic notice, seconds from now (default 30); the drill "
                             "expires at that deadline")
    parser.add_argument("--cancel", default=None, metavar="ID",
                        help="withdraw the active drill ID (printed by `spotguard drill`, listed by "
                             "`spotguard status`): subscribers get a cancel and it is no longer replayed")
    parser.add_argument("--clear", action="store_true",
                        help="withdraw every active drill (ends a rehearsal; cloud notices are the cloud's: "
                             "cancel those in the emulator, `spotguard emulate`)")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")


def _fmt_status(state: dict[str, Any]) -> str:
    lines = [
        f"spotguard daemon {state.get('daemon_version', '?')} on {state.get('node', '?')} "
        f"(pid {state.get('pid', '?')}, up {state.get('uptime_seconds', 0):.0f}s)",
        f"cloud:       {state.get('cloud', '?')}",
        f"socket:      {state.get('socket', '?')}",
    ]
    if state.get("shutting_down"):
        lines.append(f"state:       shutting down ({state.get('shutting_down')})")
    if "healthy" in state:
        lines.append("health:      sees notices" if state["healthy"] else "health:      BLIND")
        lines.extend(f"  {p}" for p in state.get("problems") or [])
    watchers = state.get("watchers") or []
    lines.append(f"watchers:    {len(watchers)}")
    for w in watchers:
        health = "healthy" if w.get("healthy") else "UNHEALTHY"
        extra = f", last error: {w['last_error']}" if w.get("last_error") and not w.get("healthy") else ""
        since = w.get("seconds_since_ok")
        since_txt = f", last ok {since:.1f}s ago" if isinstance(since, (int, float)) else ""
        lines.append(f"  {w.get('source', '?'):<7} {health}, polls {w.get('polls', 0)}, errors "
                     f"{w.get('errors', 0)}{since_txt}{extra}")
    subs = state.get("subscribers") or []
    lines.append(f"subscribers: {len(subs)}")
    for s in subs:
        lines.append(f"  pid {s.get('pid', s.get('peer_pid', '?'))} rank {s.get('rank', '?')}/"
                     f"{s.get('world_size', '?')} job {s.get('job') or '-'} uid {s.get('uid', '?')}")
    active = state.get("active_notices") or []
    lines.append(f"active:      {len(active)}")
    for n in active:
        left = n.get("seconds_left", 0)
        if isinstance(left, (int, float)) and left < 0:
            until = n.get("expires_in")
            tail = f", replayed {until:.0f}s more" if isinstance(until, (int, float)) else ""
            when = f"deadline passed {-left:.1f}s ago{tail}"
        else:
            when = f"{left:.1f}s left"
        lines.append(f"  {n['id']} {n['source']}/{n['kind']} deadline {n['deadline']} ({when})")
    last = state.get("last_notice")
    if last:
        lines.append(f"last notice: {last['id']} {last['source']}/{last['kind']} received {last['received_at']} "
                     f"deadline {last['deadline']}")
    else:
        lines.append("last notice: none")
    return "\n".join(lines)


def _ask(command: str, args: argparse.Namespace, msg: Message) -> Optional[Message]:
    """One CLI request; None, after saying why on stderr, when no daemon answers or it refuses."""
    try:
        reply = request_sync(args.socket or default_socket_path(), msg, timeout=args.timeout)
    except DaemonUnavailable as exc:
        print(f"spotguard {command}: {exc}", file=sys.stderr)
        return None
    if isinstance(reply, ErrorReply):
        print(f"spotguard {command}: daemon refused: {reply.error}", file=sys.stderr)
        return None
    return reply


def status_main(args: argparse.Namespace) -> int:
    if getattr(args, "live", False):  # reached via the python -m path; `spotguard status --live` skips argparse
        from ..live import live_main_args

        return live_main_args(args)
    reply = _ask("status", args, StatusRequest())
    if reply is None:
        return 1
    assert isinstance(reply, StatusReply)
    if getattr(args, "check", False):
        return _check(reply.state, args.json)
    if args.json:
        print(json.dumps(reply.state, indent=2, sort_keys=True))
    else:
        print(_fmt_status(reply.state))
    return 0


def _check(state: dict[str, Any], as_json: bool) -> int:
    """``status --check``: the daemon's own verdict (``healthy``, ``problems``), as an exit code."""
    healthy = state.get("healthy")
    problems = [str(p) for p in state.get("problems") or []]
    if healthy is None:  # a daemon from before health checks: its watchers' last answers
        problems = [f"{w.get('source')}: {w.get('last_error')}" for w in state.get("watchers") or []
                    if not w.get("healthy")]
        healthy = not problems
    if as_json:
        print(json.dumps({"healthy": bool(healthy), "problems": problems}))
    elif healthy:
        print(f"ok: serving {state.get('socket')}, cloud {state.get('cloud')}, every watcher sees notices")
    else:
        for p in problems:
            print(f"spotguard status --check: {p}", file=sys.stderr)
    return 0 if healthy else 1


def _clear_drills(args: argparse.Namespace) -> int:
    """``drill --clear``: cancel each active drill the daemon lists; other notices stay (and are named)."""
    reply = _ask("drill", args, StatusRequest())
    if reply is None:
        return 1
    assert isinstance(reply, StatusReply)
    active = [n for n in reply.state.get("active_notices") or [] if isinstance(n, dict)]
    drills = [str(n.get("id")) for n in active if n.get("source") == "drill"]
    others = [f"{n.get('id')} ({n.get('source')} {n.get('kind')})" for n in active if n.get("source") != "drill"]
    done: list[str] = []
    for nid in drills:
        r = _ask("drill", args, DrillCancel(id=nid))
        if r is not None:
            done.append(nid)
    if args.json:
        print(json.dumps({"cancelled": done, "not_drills": others}))
    else:
        print(f"{len(done)} drill(s) cancelled" + (f": {', '.join(done)}" if done else ""), file=sys.stderr)
        if others:
            print("still active (not drills; withdrawn by their source, e.g. the emulator's cancel, or expired "
                  f"60 s after their deadline): {', '.join(others)}", file=sys.stderr)
    return 0 if len(done) == len(drills) else 1


def drill_main(args: argparse.Namespace) -> int:
    if getattr(args, "clear", False):
        return _clear_drills(args)
    if args.cancel is not None:
        reply = _ask("drill", args, DrillCancel(id=args.cancel))
        if reply is None:
            return 1
        assert isinstance(reply, DrillOk)
        if args.json:
            print(json.dumps({"id": reply.id, "cancelled": True}))
        else:
            print(f"drill {reply.id} cancelled", file=sys.stderr)
        return 0
    if not args.deadline_in > 0:
        print("spotguard drill: --deadline-in must be greater than 0", file=sys.stderr)
        return 2
    reply = _ask("drill", args, Drill(kind=args.kind, deadline_in=args.deadline_in))
    if reply is None:
        return 1
    assert isinstance(reply, DrillOk)
    if args.json:
        print(json.dumps({"id": reply.id, "deadline": reply.deadline}))
    else:
        print(reply.id)
        print(f"{args.kind} drill sent; deadline {reply.deadline}", file=sys.stderr)
    return 0


def _standalone(argv: Optional[list[str]] = None) -> int:
    """``python -m spotguard.daemon.client status|drill`` without the full CLI."""
    parser = argparse.ArgumentParser(prog="spotguard")
    sub = parser.add_subparsers(dest="command", required=True)
    add_status_arguments(sub.add_parser("status"))
    add_drill_arguments(sub.add_parser("drill"))
    args = parser.parse_args(argv)
    return status_main(args) if args.command == "status" else drill_main(args)


if __name__ == "__main__":
    sys.exit(_standalone())
