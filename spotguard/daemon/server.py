"""Unix-socket fan-out server speaking protocol v1 (``spotguard.protocol``).

Design rules, each from a way a sidecar can hurt the job it protects:
- every client has its own bounded send queue and writer task, so a subscriber
  that stops reading (SIGSTOPped, deadlocked) never delays the others; when its
  queue overflows it is dropped;
- lines are read with a bounded reader (64 KiB incl. newline); a malformed line
  closes that client only, with a log line giving the reason;
- the socket is created 0660 without ever following or replacing a symlink or a
  non-socket, and a live daemon already on the path is never displaced.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from ..logs import get_logger
from ..protocol import (
    MAX_LINE,
    Ack,
    CheckpointDone,
    CheckpointFailed,
    CheckpointStarted,
    Drill,
    DrillCancel,
    ErrorReply,
    Hello,
    Message,
    Ping,
    ProtocolError,
    StatusRequest,
    Subscribe,
    Unknown,
    decode,
    encode,
)

__all__ = [
    "Server",
    "Client",
    "Handler",
    "PeerCred",
    "peer_credentials",
    "drill_allowed",
    "ServerStartError",
    "SocketInUse",
    "UnsafeSocketPath",
    "prepare_socket_path",
    "check_socket_dir",
    "bind_unix_socket",
]

log = get_logger("spotguard.daemon.server")

_PEERCRED = struct.Struct("3i")
REPORTS = (Ack, CheckpointStarted, CheckpointDone, CheckpointFailed)


class ServerStartError(RuntimeError):
    """The socket cannot be served; ``str()`` is one line naming the fix."""


class SocketInUse(ServerStartError):
    pass


class UnsafeSocketPath(ServerStartError):
    pass


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: Optional[socket.socket]) -> Optional[PeerCred]:
    """SO_PEERCRED of a connected Unix socket (Linux); ``None`` where unavailable."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if sock is None or opt is None:
        return None
    try:
        pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _PEERCRED.size))
    except OSError:
        return None
    return PeerCred(pid, uid, gid)


def drill_allowed(peer: Optional[PeerCred], daemon_uid: int) -> bool:
    """A drill makes every trainer checkpoint and exit: only root or the daemon's own user may."""
    return peer is not None and peer.uid in (0, daemon_uid)


def check_socket_dir(path: str, uid: Optional[int] = None) -> None:
    """Refuse a socket directory another (non-root) user controls.

    Walks every component of the socket's directory: a symlink owned by another
    non-root uid (planted to redirect the socket into a place that user owns) is
    refused, and so is a directory, after resolving links, owned by another non-root
    uid (that user could later replace our socket with theirs). Root-owned
    world-writable directories stay allowed: Kubernetes' ``emptyDir`` is 0777 root,
    and a name planted there is caught by ``prepare_socket_path``'s own checks.
    """
    me = os.geteuid() if uid is None else uid
    trusted = (0, me)
    directory = os.path.dirname(os.path.abspath(path)) or "/"
    parts = [p for p in directory.split(os.sep) if p]
    current = "/"
    for part in parts:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return  # bind reports the missing directory with its own message
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise UnsafeSocketPath(f"{current} (on the way to {path}) is a symlink owned by uid {st.st_uid}, "
                                   "neither root nor the daemon's user; refusing to follow it: choose another "
                                   "--socket or remove the link")
    try:
        st = os.stat(directory)
    except OSError:
        return
    if st.st_uid not in trusted:
        raise UnsafeSocketPath(f"socket directory {directory} is owned by uid {st.st_uid}, neither root nor the "
                               f"daemon's user ({me}); that user could replace the socket: use a directory owned by "
                               "root or the daemon's user (RuntimeDirectory=spotguard)")


def prepare_socket_path(path: str, probe_timeout: float = 1.0) -> None:
    """Clear a stale socket left by a dead daemon; refuse anything else at ``path``."""
    check_socket_dir(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketPath(f"{path} is a symlink; refusing to follow or replace it: remove it or choose "
                               "another --socket")
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafeSocketPath(f"{path} exists and is not a socket; refusing to replace it: remove it or choose "
                               "another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(probe_timeout)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listening: a dead daemon's leftover
    except socket.timeout:
        raise SocketInUse(f"{path}: a process is listening but not accepting; refusing to replace it: stop "
                          "it or choose another --socket") from None
    except OSError as exc:
        raise UnsafeSocketPath(f"{path}: cannot probe the existing socket ({exc.strerror}); remove it or "
                               "choose another --socket") from None
    else:
        raise SocketInUse(f"another spotguard daemon is already serving {path}: stop it (systemctl stop "
                          "spotguard) or choose another --socket")
    finally:
        probe.close()
    try:
        os.unlink(path)
        log.info("socket.stale_removed", socket=path)
    except FileNotFoundError:
        pass


def bind_unix_socket(path: str, mode: int = 0o660, gid: Optional[int] = None, backlog: int = 512) -> socket.socket:
    """Bind and listen with the file created at ``mode`` from the start (umask), never 0777 for a moment."""
    prepare_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SocketInUse(f"{path} appeared while starting (another daemon?): choose another --socket") from None
        raise ServerStartError(f"cannot bind {path} ({exc.strerror}): check the directory's permissions or "
                               "choose another --socket") from None
    finally:
        os.umask(old)
    try:
        os.chmod(path, mode)  # umask already did it; explicit in case of an odd filesystem
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ServerStartError(f"cannot set up {path} ({exc.strerror}): check --socket-group and permissions") from None
    sock.setblocking(False)
    return sock


class Handler(Protocol):
    """What the server asks of the daemon; all calls are synchronous and fast."""

    def hello(self) -> Hello: ...

    def on_connect(self, client: "Client") -> None: ...

    def on_subscribe(self, client: "Client") -> None: ...

    def on_report(self, client: "Client", msg: Message) -> None: ...

    def on_status(self, client: "Client") -> Message: ...

    def on_drill(self, client: "Client", msg: Drill) -> Message: ...

    def on_drill_cancel(self, client: "Client", msg: DrillCancel) -> Message: ...

    def on_delivered(self, client: "Client", notice_id: str, latency: Optional[float]) -> None: ...

    def on_disconnect(self, client: "Client", reason: str) -> None: ...


# One queued write: bytes, the notice id it carries (or None), wall-clock origin for latency.
_Item = tuple[bytes, Optional[str], Optional[float]]


class Client:
    """One connection: its peer credentials, subscription and bounded send queue."""

    def __init__(self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer: Optional[PeerCred], queue_size: int) -> None:
        self.id = cid
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.queue: asyncio.Queue[Optional[_Item]] = asyncio.Queue(maxsize=queue_size)
        self.subscribed = False
        self.info: Optional[Subscribe] = None
        self.connected_monotonic = time.monotonic()
        self.last_line_monotonic = self.connected_monotonic
        self.sent_ids: set[str] = set()
        self.closed = False
        self.close_reason: Optional[str] = None
        self.writer_task: Optional[asyncio.Task[None]] = None

    def log_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"client": self.id}
        if self.peer is not None:
            out.update(peer_pid=self.peer.pid, peer_uid=self.peer.uid, peer_gid=self.peer.gid)
        if self.info is not None:
            out.update(rank=self.info.rank, job=self.info.job)
        return out

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"client": self.id, "connected_seconds": round(time.monotonic() - self.connected_monotonic, 3)}
        if self.peer is not None:
            d.update(peer_pid=self.peer.pid, uid=self.peer.uid, gid=self.peer.gid)
        if self.info is not None:
            d.update(pid=self.info.pid, rank=self.info.rank, local_rank=self.info.local_rank,
                     world_size=self.info.world_size, job=self.info.job)
            if self.info.pod:
                d.update(pod=self.info.pod, namespace=self.info.namespace)
        d["queued"] = self.queue.qsize()
        return d


class _LineBudget:
    """Per-connection token bucket on lines read: ``burst`` at once, then ``rate`` a second.

    A client over budget is simply not read for a while (backpressure: its socket buffer
    fills and its writes block), so a flood costs the daemon almost nothing and the event
    loop stays free for the notices real subscribers are waiting for. A trainer sends a
    handful of lines per notice; ``spotguard status`` sends one.
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> float:
        """Spend one line; returns how long to wait first (0 when within budget)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


# Per-connection read budget (lines/s, burst), and how many buffered lines one client may have
# handled before the loop is handed to others: floods are bounded, and never starve subscribers.
LINE_RATE = 20.0
LINE_BURST = 64.0
YIELD_EVERY = 8
IDLE_TIMEOUT = 60.0  # seconds an unsubscribed connection may stay silent


class Server:
    """Accepts clients, frames lines, fans notices out; policy lives in the ``Handler``."""

    def __init__(self, path: str, handler: Handler, *, max_subscribers: int = 256,
                 max_connections: Optional[int] = None, queue_size: int = 256, ping_interval: float = 10.0,
                 write_timeout: float = 10.0, socket_gid: Optional[int] = None, line_rate: float = LINE_RATE,
                 line_burst: float = LINE_BURST) -> None:
        self.path = path
        self.line_rate = line_rate
        self.line_burst = line_burst
        self.handler = handler
        self.max_subscribers = max_subscribers
        self.max_connections = max_connections or (2 * max_subscribers + 32)
        self.queue_size = queue_size
        self.ping_interval = ping_interval
        self.write_timeout = write_timeout
        self.socket_gid = socket_gid
        self.clients: dict[int, Client] = {}
        self._evicted = 0
        self._ids = itertools.count(1)
        self._server: Optional[asyncio.AbstractServer] = None
        self._sock_ident: Optional[tuple[int, int]] = None
        self._ping_task: Optional[asyncio.Task[None]] = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self.found_stale = False

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        existed = os.path.lexists(self.path)
        sock = bind_unix_socket(self.path, gid=self.socket_gid)
        # Something was there and we could replace it: a daemon's leftover after kill -9 / OOM (its
        # trainers may be reconnecting right now).
        self.found_stale = existed
        st = os.stat(self.path)
        self._sock_ident = (st.st_dev, st.st_ino)
        # limit = MAX_LINE - 1: readuntil accepts a separator at index <= limit,
        # i.e. a line of at most MAX_LINE bytes including its newline.
        self._server = await asyncio.start_unix_server(self._on_connect, sock=sock, limit=MAX_LINE - 1)
        self._ping_task = asyncio.create_task(self._ping_loop(), name="spotguard-ping")

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def close(self, flush_timeout: float = 1.0) -> None:
        """Stop accepting, flush what is queued (briefly), drop everyone, remove our socket file."""
        if self._server is not None:
            self._server.close()
        if self._ping_task is not None:
            self._ping_task.cancel()
        clients = list(self.clients.values())
        for c in clients:
            self._end_queue(c)
        tasks = [c.writer_task for c in clients if c.writer_task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=flush_timeout)
        for c in clients:
            self.disconnect(c, "daemon shutting down", log_it=False)
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=flush_timeout)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), flush_timeout)
            except asyncio.TimeoutError:
                pass
            self._server = None
        self._unlink_own_socket()

    def _unlink_own_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._sock_ident:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # --- sending -------------------------------------------------------------

    def subscribers(self) -> list[Client]:
        return [c for c in self.clients.values() if c.subscribed and not c.closed]

    def send(self, client: Client, msg: Message | bytes, notice_id: Optional[str] = None,
             origin: Optional[float] = None) -> bool:
        """Queue one message; a full queue means the client is not reading: drop it."""
        if client.closed:
            return False
        data = msg if isinstance(msg, bytes) else encode(msg)
        try:
            client.queue.put_nowait((data, notice_id, origin))
        except asyncio.QueueFull:
            self.disconnect(client, f"send queue overflow ({self.queue_size} messages): client is not reading")
            return False
        if notice_id is not None:
            client.sent_ids.add(notice_id)
        return True

    def broadcast(self, msg: Message, notice_id: Optional[str] = None, origin: Optional[float] = None,
                  skip_seen: bool = True) -> list[Client]:
        """Queue ``msg`` to every subscriber (encoded once); returns those it was queued to."""
        data = encode(msg)
        sent = []
        for c in self.subscribers():
            if skip_seen and notice_id is not None and notice_id in c.sent_ids:
                continue
            if self.send(c, data, notice_id, origin):
                sent.append(c)
        return sent

    def disconnect(self, client: Client, reason: str, *, flush: bool = False, log_it: bool = True) -> None:
        """Drop a client now (or after its queue drains, with ``flush``); idempotent."""
        if client.closed:
            return
        self._mark_closed(client, reason)
        if log_it:
            log.warning("client.dropped", reason=reason, **client.log_fields())
        if flush:
            self._end_queue(client)
        else:
            if client.writer_task is not None:
                client.writer_task.cancel()
            client.writer.transport.abort()
        self.handler.on_disconnect(client, reason)

    def _mark_closed(self, client: Client, reason: str) -> None:
        client.closed = True
        client.close_reason = reason
        self.clients.pop(client.id, None)

    def _end_queue(self, client: Client) -> None:
        """Ask the writer to stop after what is queued, even if the queue is full."""
        try:
            client.queue.put_nowait(None)
        except asyncio.QueueFull:
            if client.writer_task is not None:
                client.writer_task.cancel()
            client.writer.transport.abort()

    # --- per connection ------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_credentials(writer.get_extra_info("socket"))
        client = Client(next(self._ids), reader, writer, peer, self.queue_size)
        if len(self.clients) >= self.max_connections:
            # A connection flood must not lock real clients out: make room by dropping the oldest
            # connection that never subscribed (subscribers are never evicted; they have their own limit).
            victim = next((c for c in self.clients.values() if not c.subscribed and not c.closed), None)
            if victim is not None:
                self._evicted += 1
                if self._evicted == 1 or self._evicted % 1000 == 0:  # one line per storm, not one per connection
                    log.warning("client.evicted", reason=f"connection limit {self.max_connections} reached: "
                                "dropped the oldest connection that never subscribed", evicted_total=self._evicted,
                                **victim.log_fields())
                self.disconnect(victim, "evicted: connection limit reached", log_it=False)
        if len(self.clients) >= self.max_connections:
            log.warning("client.refused", reason=f"too many connections (max {self.max_connections})",
                        **client.log_fields())
            writer.write(encode(ErrorReply(error=f"too many connections (max {self.max_connections})")))
            writer.transport.close()  # flushes the one line, then closes
            return
        self.clients[client.id] = client
        client.writer_task = asyncio.create_task(self._writer_loop(client), name=f"spotguard-writer-{client.id}")
        # Debug only: `spotguard status` as a health check would otherwise flood the journal.
        log.debug("client.connected", **client.log_fields())
        self.handler.on_connect(client)
        self.send(client, self.handler.hello())
        reason = "client closed the connection"
        budget = _LineBudget(self.line_rate, self.line_burst)
        lines = 0
        try:
            while not client.closed:
                wait = budget.take()
                lines += 1
                if wait > 0:
                    await asyncio.sleep(wait)  # over budget: stop reading this client for a while
                elif lines % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # buffered lines never monopolise the loop
                if client.closed:
                    break
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        reason = f"connection closed mid-line ({len(exc.partial)} bytes without newline)"
                    break
                except asyncio.LimitOverrunError:
                    # Replies to the valid lines before it still go out (flush), then close.
                    self.disconnect(client, f"malformed line: longer than {MAX_LINE} bytes", flush=True)
                    return
                except (ConnectionError, OSError) as exc:
                    reason = f"read error: {exc}"
                    break
                client.last_line_monotonic = time.monotonic()
                try:
                    msg = decode(line)
                except ProtocolError as exc:
                    self.disconnect(client, f"malformed line: {exc}", flush=True)
                    return
                try:
                    self._dispatch(client, msg)
                except Exception as exc:  # a daemon bug must cost one client, never the server
                    log.error("client.handler_error", message_type=msg.type, error=repr(exc), exc_info=True,
                              **client.log_fields())
                    self.send(client, ErrorReply(error=f"internal error handling {msg.type}"))
                    self.disconnect(client, f"internal error handling {msg.type}", flush=True)
                    return
        except asyncio.CancelledError:
            reason = "daemon shutting down"
            raise
        finally:
            if not client.closed:
                self._mark_closed(client, reason)
                if client.writer_task is not None:
                    client.writer_task.cancel()
                writer.transport.abort()
                (log.info if client.subscribed else log.debug)("client.disconnected", reason=reason,
                                                                **client.log_fields())
                self.handler.on_disconnect(client, reason)

    def _dispatch(self, client: Client, msg: Message) -> None:
        if isinstance(msg, Subscribe):
            if not client.subscribed and len(self.subscribers()) >= self.max_subscribers:
                self.send(client, ErrorReply(error=f"too many subscribers (max {self.max_subscribers}); "
                                                   "raise --max-subscribers"))
                self.disconnect(client, f"too many subscribers (max {self.max_subscribers})", flush=True)
                return
            first = not client.subscribed
            client.subscribed = True
            client.info = msg
            if first:
                log.info("client.subscribed", pid=msg.pid, world_size=msg.world_size, local_rank=msg.local_rank,
                         **client.log_fields())
            self.handler.on_subscribe(client)
        elif isinstance(msg, StatusRequest):
            self.send(client, self.handler.on_status(client))
        elif isinstance(msg, Drill):
            self.send(client, self.handler.on_drill(client, msg))
        elif isinstance(msg, DrillCancel):
            self.send(client, self.handler.on_drill_cancel(client, msg))
        elif isinstance(msg, REPORTS):
            self.handler.on_report(client, msg)
        elif isinstance(msg, Unknown):
            log.debug("client.unknown_type_ignored", message_type=msg.name, **client.log_fields())

    async def _writer_loop(self, client: Client) -> None:
        writer = client.writer
        transport = writer.transport
        try:
            while True:
                item = await client.queue.get()
                if item is None:
                    # Graceful end: what was written is flushed by the transport, then closed.
                    transport.close()
                    if not client.closed:
                        self._mark_closed(client, "daemon shutting down")
                        self.handler.on_disconnect(client, "daemon shutting down")
                    return
                data, notice_id, origin = item
                writer.write(data)
                if transport.get_write_buffer_size():
                    await asyncio.wait_for(writer.drain(), self.write_timeout)
                if notice_id is not None:
                    latency = None if origin is None else max(0.0, time.time() - origin)
                    self.handler.on_delivered(client, notice_id, latency)
        except asyncio.TimeoutError:
            self.disconnect(client, f"write stalled for {self.write_timeout:g}s: client is not reading")
        except (ConnectionError, OSError) as exc:
            self.disconnect(client, f"write failed: {exc}", log_it=False)
        except asyncio.CancelledError:
            pass

    async def _ping_loop(self) -> None:
        """Pings make a dead peer's socket error out, so it leaves the subscriber count."""
        ping = encode(Ping())
        while True:
            await asyncio.sleep(self.ping_interval)
            now = time.monotonic()
            for c in list(self.clients.values()):
                if not c.subscribed and now - c.last_line_monotonic > IDLE_TIMEOUT:
                    # A connection that neither subscribed nor asked anything holds a slot for nothing.
                    self.disconnect(c, f"idle for {IDLE_TIMEOUT:g}s without subscribing", log_it=False)
                    continue
                self.send(c, ping)
