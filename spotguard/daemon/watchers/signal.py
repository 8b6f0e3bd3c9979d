"""The daemon's own SIGTERM as a notice source, with ``--sigterm-notice`` only.

By default a SIGTERM to the daemon is a clean stop (a rollout, an upgrade, a
restart must never stop training; trainers get their own SIGTERM at shutdown).
Where a trainer gets no signal of its own, ``--sigterm-notice`` turns the
daemon's SIGTERM into a ``termination`` notice (deadline ``--sigterm-grace``),
the same emergency path as a cloud notice. The daemon installs the signal
handler and calls ``trigger``.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import AsyncIterator, Optional

from ...notice import Notice, WatchEvent, stable_id
from ...timefmt import utcnow
from .base import Watcher

__all__ = ["SignalWatcher"]


class SignalWatcher(Watcher):
    source = "signal"

    def __init__(self) -> None:
        super().__init__()
        self._queue: asyncio.Queue[Optional[Notice]] = asyncio.Queue()
        self._started = utcnow()
        self.notice: Optional[Notice] = None

    def trigger(self, grace: float, signame: str = "SIGTERM") -> Optional[Notice]:
        """Queue the termination notice; only the first signal makes one (returns None after)."""
        if self.notice is not None:
            return None
        now = utcnow()
        self.notice = Notice(
            # One id per daemon life: a second SIGTERM must not re-send.
            id=stable_id("signal", signame, os.getpid(), self._started.isoformat()),
            source="signal",
            kind="termination",
            deadline=now + timedelta(seconds=grace),
            received_at=now,
            detail=f"{signame} received by spotguard daemon (pid {os.getpid()}); grace {grace:g}s",
        )
        self.health.ok()
        self._queue.put_nowait(self.notice)
        return self.notice

    async def events(self) -> AsyncIterator[WatchEvent]:
        if self.notice is not None and self._queue.empty():
            yield self.notice  # re-yield after a loop restart; the book de-duplicates
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    async def close(self) -> None:
        self._queue.put_nowait(None)
