"""The hook's side of the daemon socket: a background thread that subscribes and hands notices over.

Why a plain thread with blocking-style socket I/O (select on one socket and a
wake-up pipe) rather than asyncio: the training thread owns the process, may
never yield, and must never wait on us. The thread reconnects on its own when
the daemon restarts, and ``report()`` only enqueues, so a stalled daemon can
never stall a training step. Callbacks run on this thread: keep them cheap
(set a flag, note the deadline).
"""

from __future__ import annotations

import collections
import os
import random as _random_mod
import select
import socket
import threading
import time
from typing import Callable, Deque

from .. import protocol
from ..logs import get_logger
from ..notice import Notice

__all__ = ["NoticeIntake", "ENV_SOCKET", "resolve_socket_path"]

ENV_SOCKET = "SPOTGUARD_SOCKET"
BACKOFF_MIN = 0.05
HELLO_TIMEOUT = 5.0  # a daemon that accepts but never says hello is treated as broken
CONNECT_TIMEOUT = 2.0
OUT_MAX = 1 << 20  # bytes of unsent reports kept while the daemon does not read
QUEUE_MAX = 1024  # reports waiting for the thread
_IN = select.POLLIN | select.POLLHUP | select.POLLERR  # readable, or a hang-up recv() will report

def resolve_socket_path(socket_path: str | os.PathLike[str] | None = None) -> str:
    """The argument, else ``$SPOTGUARD_SOCKET``, else ``protocol.DEFAULT_SOCKET``."""
    if socket_path:
        return os.fspath(socket_path)
    return os.environ.get(ENV_SOCKET) or protocol.DEFAULT_SOCKET


class _Malformed(Exception):
    """The daemon sent something we cannot parse: drop the connection and reconnect."""


class NoticeIntake:
    """Subscribes to the spotguard daemon and delivers notices to ``on_notice``.

    Each notice id is delivered once per intake (the daemon replays active
    notices after a reconnect; those are acked again but not re-delivered unless
    cancelled in between). Every notice received is acked after its callback.
    """

    def __init__(
        self,
        socket_path: str | None,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        job: str,
        on_notice: Callable[[Notice], None],
        on_cancel: Callable[[str], None] | None = None,
        backoff_max: float = 2.0,
    ) -> None:
        self.socket_path: str = resolve_socket_path(socket_path)
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.job = job
        self.on_notice = on_notice
        self.on_cancel = on_cancel
        self.backoff_max = max(BACKOFF_MIN, float(backoff_max))
        self.connected = threading.Event()
        # Set once the daemon answered the ``status`` sent right after ``subscribe``: it queues every
        # still-active notice (the replay) before that reply on the same connection, so by then each
        # replayed notice has gone through ``on_notice``.
        self.replayed = threading.Event()
        self.hello: protocol.Hello | None = None  # the daemon's last hello (node, cloud, sources)
        self._stop = threading.Event()
        self._queue: Deque[bytes] = collections.deque()
        self._qlock = threading.Lock()
        self._idle = threading.Event()  # set while no report is queued or unsent
        self._idle.set()
        # A private generator: drawing jitter from the global ``random`` would change the
        # user's RNG stream and break bitwise-identical resume.
        self._rng = _random_mod.Random()
        self._seen: set[str] = set()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        # A lazy proxy (not .bind()): picks up whatever logging config is current at each call.
        self._log = get_logger("spotguard.hook.intake", rank=rank, socket=self.socket_path)

    # -- public API ----------------------------------------------------------

    def start(self) -> None:
        """Start the background daemon thread (idempotent)."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._run, name=f"spotguard-intake-{self.rank}", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until subscribed; True if subscribed."""
        return self.connected.wait(timeout)

    def report(self, msg: protocol.Message) -> None:
        """Send ``msg`` to the daemon from the intake thread; never blocks, never raises.

        Dropped (debug log) when not subscribed or when too many reports are pending.
        """
        if not self.connected.is_set() or self._closed:
            self._log.debug("report dropped: not connected to daemon", type=msg.type)
            return
        try:
            line = protocol.encode(msg)
        except (protocol.ProtocolError, TypeError, ValueError) as exc:
            self._log.warning("report dropped: cannot encode", type=msg.type, error=str(exc))
            return
        with self._qlock:
            if len(self._queue) >= QUEUE_MAX:
                self._log.debug("report dropped: queue full", type=msg.type)
                return
            self._idle.clear()
            self._queue.append(line)
        self._wake()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every queued report was written to the socket.

        Called right before the process exits, so that ``checkpoint_done`` reaches
        the daemon. True when nothing is left to send.
        """
        if not self.connected.is_set():
            return self._idle.is_set()
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the thread and close the socket (idempotent, bounded to ~2 s)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
        self.connected.clear()
        if t is not None and t.is_alive():  # a callback is stuck: leave its fds alone rather than reuse them
            self._log.warning("intake thread did not stop within 2 s (a callback is blocking?)")
            return
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "NoticeIntake":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full (already awake) or closed
            pass

    def _run(self) -> None:
        delay = BACKOFF_MIN
        warned_absent = False
        ever_connected = False
        while not self._stop.is_set():
            try:
                sock = self._connect()
            except OSError as exc:
                if not warned_absent and not ever_connected:
                    warned_absent = True
                    self._log.warning(
                        f"no spotguard daemon at {self.socket_path}: acting on SIGTERM/SIGUSR1 only; "
                        f"start `spotguard daemon` or set {ENV_SOCKET}",
                        error=f"{type(exc).__name__}: {exc}",
                    )
                else:
                    self._log.debug("daemon connect failed", error=str(exc), retry_in=delay)
                self._stop.wait(delay * self._rng.uniform(0.5, 1.0))
                delay = min(delay * 2, self.backoff_max)
                continue
            subscribed = False
            try:
                subscribed = self._session(sock)
                reason = "daemon closed the connection"
            except _Malformed as exc:
                subscribed = subscribed or self.connected.is_set()
                reason = f"malformed message from daemon: {exc}"
            except OSError as exc:
                subscribed = subscribed or self.connected.is_set()
                reason = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # never let the intake thread die silently
                subscribed = subscribed or self.connected.is_set()
                reason = f"unexpected {type(exc).__name__}: {exc}"
                self._log.exception("intake error")
            finally:
                self.connected.clear()
                self.replayed.clear()
                try:
                    sock.close()
                except OSError:
                    pass
            if self._stop.is_set():
                break
            if subscribed:
                ever_connected = True
                delay = BACKOFF_MIN
                self._log.warning("lost connection to spotguard daemon; reconnecting", reason=reason)
            else:
                self._log.debug("daemon session ended before subscribe", reason=reason)
            self._stop.wait(delay * self._rng.uniform(0.5, 1.0))
            delay = min(delay * 2, self.backoff_max)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(self.socket_path)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _session(self, sock: socket.socket) -> bool:
        """Serve one connection until EOF or stop; returns whether it got as far as subscribing."""
        inbuf = bytearray()
        out = bytearray()
        subscribed = False
        hello_deadline = time.monotonic() + HELLO_TIMEOUT
        poller = select.poll()
        poller.register(sock, _IN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            if subscribed:
                with self._qlock:
                    while self._queue:
                        line = self._queue.popleft()
                        if len(out) + len(line) > OUT_MAX:
                            self._log.debug("report dropped: daemon is not reading")
                            continue
                        out += line
            timeout = 1.0 if subscribed else max(0.0, hello_deadline - time.monotonic())
            # poll, not select: a big training process can hold fds beyond select's 1024 limit.
            poller.modify(sock, _IN | (select.POLLOUT if out else 0))
            events = dict(poller.poll(timeout * 1000.0))
            writable = events.get(sock.fileno(), 0) & select.POLLOUT
            if events.get(self._wake_r, 0):
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if writable:
                try:
                    sent = sock.send(out)
                    del out[:sent]
                except BlockingIOError:
                    pass
            if subscribed and not out:
                with self._qlock:
                    if not self._queue:
                        self._idle.set()
            if events.get(sock.fileno(), 0) & _IN:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    data = None
                if data == b"":
                    return subscribed
                if data:
                    inbuf += data
                    while True:
                        nl = inbuf.find(b"\n")
                        if nl < 0:
                            break
                        line = bytes(inbuf[:nl])
                        del inbuf[: nl + 1]
                        if len(line) + 1 > protocol.MAX_LINE:
                            raise _Malformed(f"line of {len(line)} bytes exceeds {protocol.MAX_LINE}")
                        if not line.strip():
                            continue
                        if self._handle(line, subscribed, out):
                            subscribed = True
                    if len(inbuf) >= protocol.MAX_LINE:
                        raise _Malformed(f"no newline within {protocol.MAX_LINE} bytes")
            if not subscribed and time.monotonic() >= hello_deadline:
                raise _Malformed(f"no hello within {HELLO_TIMEOUT:g} s")
        return subscribed

    def _handle(self, line: bytes, subscribed: bool, out: bytearray) -> bool:
        """Act on one daemon line; returns True when it completed the subscription (hello seen)."""
        try:
            msg = protocol.decode(line, from_daemon=True)
        except protocol.ProtocolError as exc:
            raise _Malformed(str(exc)) from None
        if isinstance(msg, protocol.Unknown):
            self._log.debug("ignoring unknown daemon message", type=msg.name)
            return False
        if not subscribed:
            if not isinstance(msg, protocol.Hello):
                raise _Malformed(f"expected hello first, got {msg.type}")
            if msg.version != protocol.VERSION:
                self._log.warning("daemon speaks another protocol version", daemon_version=msg.version,
                                  ours=protocol.VERSION)
            self.hello = msg
            pod, namespace = protocol.pod_identity()  # downward API: the daemon's Events name this pod
            out += protocol.encode(
                protocol.Subscribe(pid=os.getpid(), rank=self.rank, local_rank=self.local_rank,
                                   world_size=self.world_size, job=self.job, pod=pod, namespace=namespace)
            ) + protocol.encode(protocol.StatusRequest())  # its reply marks the end of the replay
            self.connected.set()
            self._log.info("subscribed to spotguard daemon", node=msg.node, cloud=msg.cloud,
                           sources=msg.sources)
            return True
        if isinstance(msg, protocol.NoticeMsg):
            notice = msg.notice
            if notice.id not in self._seen:
                self._seen.add(notice.id)
                self._log.info("notice received", notice_id=notice.id, source=notice.source, kind=notice.kind,
                               seconds_left=round(notice.seconds_left(), 3))
                self._call(self.on_notice, notice)
            out += protocol.encode(protocol.Ack(id=notice.id))
        elif isinstance(msg, protocol.CancelMsg):
            self._seen.discard(msg.id)
            self._log.info("notice cancelled", notice_id=msg.id)
            if self.on_cancel is not None:
                self._call(self.on_cancel, msg.id)
        elif isinstance(msg, protocol.ErrorReply):
            self._log.warning("daemon reported an error", error=msg.error)
        elif isinstance(msg, protocol.Hello):
            self.hello = msg
        elif isinstance(msg, protocol.StatusReply):
            self.replayed.set()
        # ping, status, drill_ok: nothing to do
        return False

    def _call(self, fn: Callable[..., None], arg: object) -> None:
        try:
            fn(arg)
        except Exception:
            self._log.exception("intake callback raised", callback=getattr(fn, "__name__", repr(fn)))
