"""The hook's side of the history: a log tap that hands events to one background writer thread.

Why a tap on the hook's logger: every event worth keeping is already logged, once, at the
moment it happens (``spotguard/hook/events.py``); wrapping the logger records them without a
second call site in the hook, and nothing runs on the per-step path (the hook logs nothing
per step). The training and agreement threads only append to a bounded queue; the writer
thread does the storage I/O. A full queue, a failing store or a slow one costs history
entries (counted, logged once), never a save or a step. At ``exit`` the exiting thread
waits (bounded) for the queue to drain, since the process ends right after.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import time
import uuid
from typing import Any, Callable, Optional

from ..logs import get_logger
from ..storage.base import Storage
from .record import KINDS, Event, event_key

__all__ = ["HistoryWriter", "LogTap", "tap", "history_enabled", "process_started"]

#: events one process may write (a loop of notices cannot fill the store)
MAX_EVENTS = 2000
#: shares of MAX_EVENTS: weeks of periodic checkpoints, or a storm of notices, must not leave the events that
#: end an attempt (its save, peers lost) without room; ``exit`` (once or twice a process) is never refused
ROUTINE_SHARE, OTHER_SHARE = 0.7, 0.9
_SHARE = {"periodic_committed": ROUTINE_SHARE, "periodic_failed": ROUTINE_SHARE,
          **{k: 1.0 for k in ("agreed", "checkpoint_started", "checkpoint_committed", "checkpoint_failed",
                              "checkpoint_late", "checkpoint_skipped", "peers_lost")}}
QUEUE_SIZE = 512
#: the exiting thread waits at most this long for the pending entries (less when the deadline is nearer)
EXIT_FLUSH = 1.0
#: written by rank 0 only: what the whole job did (every rank logs them alike)
JOB_WIDE = frozenset({"resumed", "agreed", "checkpoint_started", "checkpoint_committed", "checkpoint_failed",
                      "checkpoint_late", "checkpoint_skipped", "periodic_committed", "periodic_failed"})
#: written by every rank: which node received a notice is information (a notice may reach one node only)
PER_RANK = frozenset({"notice_seen"})
#: everything else: rank 0 and each node's local leader (LOCAL_RANK 0), for the timeline per node
#: a notice's save is (about to be) in flight: the writer holds its entries until it ends (never competes with it)
HOLD_FROM = frozenset({"notice_seen", "agreed", "checkpoint_started"})
HOLD_UNTIL = frozenset({"checkpoint_committed", "checkpoint_failed", "checkpoint_skipped", "notice_cancelled",
                        "exit", "peers_lost"})
#: the longest hold (a save that never ends must not cost the history)
MAX_HOLD = 60.0
#: a quiet process rewrites its one ``alive`` entry this often (``SPOTGUARD_HISTORY_ALIVE`` s; 0 turns it off)
ALIVE_EVERY = 300.0
#: the hold ends this long before the notice's deadline (the entries must be out before the VM is gone)
HOLD_MARGIN = 2.0


def history_enabled() -> bool:
    """``SPOTGUARD_HISTORY=0`` turns the history off (the benchmark's "without" run)."""
    return os.environ.get("SPOTGUARD_HISTORY", "1").strip() != "0"


#: pid -> run of the first writer that recorded ``hook_installed`` in this process
_STARTED_PIDS: dict[int, str] = {}


def alive_every() -> float:
    """Seconds between ``alive`` rewrites: a process that vanishes without ``exit`` is known up to this long."""
    try:
        return max(0.0, float(os.environ.get("SPOTGUARD_HISTORY_ALIVE", ALIVE_EVERY)))
    except ValueError:
        return ALIVE_EVERY


def process_started() -> Optional[float]:
    """This process's start (epoch s) from /proc: the restart's share of the downtime begins here."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class HistoryWriter:
    """One process's history entries, written by a daemon thread in the order they were recorded."""

    def __init__(self, storage: Storage, *, rank: int = 0, local_rank: int = 0,
                 step_of: Optional[Callable[[], Any]] = None) -> None:
        self.storage, self.rank, self.local_rank = storage, rank, local_rank
        self._step_of = step_of
        self._exited = False  # an ``exit`` event was recorded: the process end needs no other
        self._pid = os.getpid()  # a forked child inherits this object, not its thread: it records nothing
        self.run = uuid.uuid4().hex[:12]
        self.node = socket.gethostname()
        self.dropped = 0
        self.written = 0
        self._seq = 0
        self._q: "queue.Queue[Event]" = queue.Queue(QUEUE_SIZE)
        self._idle = threading.Condition()
        self._pending = 0
        self._hold_until = 0.0  # monotonic: the writer waits until then (a notice's save in flight)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._alive_every = alive_every()
        self._alive_key: Optional[str] = None  # one object per process, rewritten in place (no count, no cap)
        self._log = get_logger("spotguard.history", component="history", rank=rank)
        atexit.register(self._at_exit)  # a plain process end: mark it, and write what is queued

    def wants(self, kind: str) -> bool:
        """Whether this process writes ``kind`` (job-wide events: rank 0 only)."""
        if kind not in KINDS:
            return False
        if kind in JOB_WIDE:
            return self.rank == 0
        return kind in PER_RANK or self.rank == 0 or self.local_rank == 0

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        """Queue one event if this process writes its kind (any thread, never blocks, never raises).

        Every kind is seen here, wanted or not: a commit written by rank 0 also ends another rank's hold.
        """
        try:
            if os.getpid() != self._pid:
                return
            if kind in HOLD_FROM or kind in HOLD_UNTIL:
                self._hold(kind, fields)
            if kind == "exit":
                self._exited = True
            if not self.wants(kind):
                return
            with self._lock:
                if kind != "exit" and self._seq >= int(MAX_EVENTS * _SHARE.get(kind, OTHER_SHARE)):
                    self._drop("the per-process limit", MAX_EVENTS)
                    return
                self._seq += 1
                seq = self._seq
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="spotguard-history", daemon=True)
                    self._thread.start()
            if kind == "hook_installed":  # only a process's first hook starts with the process (no restart after)
                first = _STARTED_PIDS.setdefault(os.getpid(), self.run) == self.run
                fields = {**fields, "process_started": process_started() if first else None}
            ev = Event(kind=kind, time=time.time(), run=self.run, rank=self.rank, node=self.node,
                       local_rank=self.local_rank, fields={**fields, "seq": seq})
            with self._idle:
                self._pending += 1
            try:
                self._q.put_nowait(ev)
            except queue.Full:
                with self._idle:
                    self._pending -= 1
                self._drop("a full queue", QUEUE_SIZE)
        except Exception as exc:  # noqa: BLE001 - the history never fails the caller
            self._warn("record", exc)

    def _hold(self, kind: str, fields: dict[str, Any]) -> None:
        """Start, keep or end the hold. It ends ``HOLD_MARGIN`` s before the notice's deadline at the latest:
        a VM that goes at its deadline (a save too slow for it) still leaves the notice in the history."""
        now = time.monotonic()
        with self._idle:
            if kind in HOLD_UNTIL:
                self._hold_until = 0.0
            else:
                left = fields.get("seconds_left")
                span = MAX_HOLD if isinstance(left, bool) or not isinstance(left, (int, float)) \
                    else max(0.0, min(MAX_HOLD, left - HOLD_MARGIN))
                held = self._hold_until > now
                self._hold_until = min(self._hold_until, now + span) if held else now + span
            self._idle.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every queued event is written (or given up); True if so."""
        end = time.monotonic() + max(0.0, timeout)
        with self._idle:
            while self._pending > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """The hook is closed (its process may go on: a sweep, a notebook, a second training): the attempt ends
        here, not at the process end; what is queued goes out (bounded)."""
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # noqa: BLE001
            pass
        if not self._exited:  # an exit already went out, flushed within its deadline: never wait again
            self._at_exit()

    def _at_exit(self) -> None:
        """A process that ends without a notice (the job finished, or failed) still marks its end."""
        if os.getpid() != self._pid:  # a forked child's end is not this attempt's (and it has no writer thread)
            return
        with self._idle:
            self._hold_until = 0.0  # nothing is in flight any more
            self._idle.notify_all()
        if self._exited or self._seq == 0 or not self.wants("exit"):
            self.flush(EXIT_FLUSH)  # what this rank queued (its notice_seen) still goes out
            return
        self._exited = True  # once: close() then the process end write one exit
        try:
            step = self._step_of() if self._step_of is not None else None
        except Exception:  # noqa: BLE001
            step = None
        self.record("exit", {"reason": "process_end", "code": None, "step": step})
        self.flush(EXIT_FLUSH)

    def _alive(self) -> None:
        """Rewrite this process's ``alive`` entry (time, step): a SIGKILL/OOM/lost VM leaves no ``exit``, and
        without it the report would count the whole span since the last event as downtime."""
        if self._exited or self._hold_until > time.monotonic() or not self.wants("alive"):
            return
        try:
            step = self._step_of() if self._step_of is not None else None
            now = time.time()
            self._alive_key = self._alive_key or event_key(now, self.run, self.rank, 0)
            ev = Event(kind="alive", time=now, run=self.run, rank=self.rank, node=self.node,
                       local_rank=self.local_rank, fields={"step": step, "seq": 0})
            self.storage.write_bytes(self._alive_key, ev.to_json())
            self.storage.write_log.discard(self._alive_key)
        except Exception as exc:  # noqa: BLE001 - a failing store costs entries, never the job
            self._warn("write", exc)

    def _loop(self) -> None:
        while True:
            try:
                ev = self._q.get(timeout=self._alive_every or None)
            except queue.Empty:  # quiet: a training loop logs nothing per step
                self._alive()
                continue
            with self._idle:  # a notice's save is in flight: its I/O first, these entries after
                while (left := self._hold_until - time.monotonic()) > 0:
                    self._idle.wait(left)
            try:
                key = event_key(ev.time, ev.run, ev.rank, int(ev.fields["seq"]))
                self.storage.write_bytes(key, ev.to_json())
                try:
                    self.storage.write_log.discard(key)  # not part of any checkpoint
                except Exception:  # noqa: BLE001
                    pass
                self.written += 1
            except Exception as exc:  # noqa: BLE001 - a failing store costs entries, never the job
                self._warn("write", exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _drop(self, why: str, limit: int) -> None:
        self.dropped += 1
        if why not in self._warned:
            self._warned.add(why)
            self._log.warning("history entries dropped", why=why, limit=limit, dropped=self.dropped)

    def _warn(self, what: str, exc: BaseException) -> None:
        name = f"{what}:{type(exc).__name__}"
        if name not in self._warned:  # once per kind of failure: a dead store must not flood the log
            self._warned.add(name)
            self._log.warning("history entry not written", error=f"{type(exc).__name__}: {exc}"[:300],
                              uri=getattr(self.storage, "uri", None),
                              detail="the job and its checkpoints are unaffected; `spotguard report` will miss it")


class LogTap:
    """A logger that also records the history's events: forwards every call, then hands a copy to the writer."""

    def __init__(self, inner: Any, writer: HistoryWriter) -> None:
        self._inner, self._writer = inner, writer

    def _tap(self, level: str, event: Any, kw: dict[str, Any]) -> Any:
        out = getattr(self._inner, level)(event, **kw)
        if isinstance(event, str) and event in KINDS:
            self._writer.record(event, kw)
            if event == "exit":  # the process leaves next (often with os._exit): write what is pending now
                left = kw.get("seconds_left")
                bound = EXIT_FLUSH if not isinstance(left, (int, float)) else max(0.05, min(EXIT_FLUSH, left - 0.5))
                self._writer.flush(bound)
        return out

    def debug(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("debug", event, kw)

    def info(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("info", event, kw)

    def warning(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("warning", event, kw)

    warn = warning

    def error(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("error", event, kw)

    def exception(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("exception", event, kw)

    def critical(self, event: Any = None, **kw: Any) -> Any:
        return self._tap("critical", event, kw)

    def bind(self, **kw: Any) -> "LogTap":
        return LogTap(self._inner.bind(**kw), self._writer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def tap(log: Any, writer: Optional[HistoryWriter]) -> Any:
    """``log`` itself when there is no writer (history off), else a ``LogTap`` over it."""
    return log if writer is None else LogTap(log, writer)


def for_hook(storage: Storage, rank: int, local_rank: int,
             step_of: Optional[Callable[[], Any]] = None) -> Optional[HistoryWriter]:
    """The hook's writer, or None with ``SPOTGUARD_HISTORY=0``; ``step_of``: the count at a plain process end."""
    return HistoryWriter(storage, rank=rank, local_rank=local_rank, step_of=step_of) if history_enabled() else None
