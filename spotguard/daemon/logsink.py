"""The daemon's log stream, kept off the delivery path: writing a log line never blocks, never raises.

Why: the daemon's stderr is a pipe (container runtime, journald, a supervisor) that
can close (EPIPE), fill up (a reader that stalls: a blocking write would freeze the
event loop, and with it every notice), or sit on a full disk (ENOSPC, ``/dev/full``).
structlog's ``WriteLogger`` calls ``write``/``flush`` on this object: ``write`` only
appends to a bounded in-memory queue; one background thread does the ``os.write``
calls. A failed write is counted by errno name and the line dropped; a full queue
drops the line and counts it. Both counters are exported as metrics
(``spotguard_log_write_errors_total``, ``spotguard_log_lines_dropped_total``).
"""

from __future__ import annotations

import collections
import errno
import os
import sys
import threading
from typing import Deque, Optional

__all__ = ["LogSink"]

MAX_QUEUED = 10_000


class LogSink:
    """A file-like for log lines; ``fd`` None drops everything (no stderr at all)."""

    def __init__(self, fd: Optional[int], max_queued: int = MAX_QUEUED) -> None:
        self.fd = fd
        self.max_queued = max_queued
        self.write_errors: dict[str, int] = {}
        self.dropped = 0
        self._queue: Deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._thread: Optional[threading.Thread] = None
        if fd is not None:
            self._thread = threading.Thread(target=self._run, name="spotguard-log-writer", daemon=True)
            self._thread.start()

    @classmethod
    def for_stderr(cls) -> "LogSink":
        try:
            fd = sys.stderr.fileno() if sys.stderr is not None else None
        except (AttributeError, OSError, ValueError):
            fd = None
        return cls(fd)

    # --- the file-like side (event loop thread, any thread) ---------------------

    def write(self, text: str) -> int:
        with self._cond:
            if self.fd is None or self._closed or len(self._queue) >= self.max_queued:
                self.dropped += 1
                return 0
            self._queue.append(text)
            self._cond.notify()
        return len(text)

    def flush(self) -> None:
        """Nothing to do here: the writer thread flushes (never the caller)."""

    def close(self, timeout: float = 1.0) -> None:
        """Let the writer drain for at most ``timeout`` seconds; lines left then are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def errors_total(self) -> int:
        return sum(self.write_errors.values())

    # --- the writer thread --------------------------------------------------------

    def _run(self) -> None:
        assert self.fd is not None
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                text = self._queue.popleft()
            self._write(text.encode("utf-8", errors="replace"))

    def _write(self, data: bytes) -> None:
        assert self.fd is not None
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except OSError as exc:
                name = errno.errorcode.get(exc.errno or 0, "OSError")
                with self._cond:
                    self.write_errors[name] = self.write_errors.get(name, 0) + 1
                return
            view = view[n:]
