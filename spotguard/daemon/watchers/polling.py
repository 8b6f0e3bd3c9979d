"""The poll loops shared by the AWS and Azure watchers: one per metadata path.

Each path (``_paths``) runs in its own task: one request (``_poll``), its events
queued for ``events``, then a sleep — the rest of ``poll_interval`` after a good
answer, or at least its own jittered backoff (and any ``Retry-After``) after a
fault. A path that keeps failing (AWS rebalance 500s, Azure ``compute`` down)
therefore never delays another beyond that path's own interval: a spot notice is
read on time while its neighbour backs off. A bug inside a poll is logged and
counted as an ``internal`` error, never raised. Log events are named after the
watcher's ``source``: ``<source>_watcher_started``, ``<source>_watcher_internal_error``,
``<source>_poll_error`` (a warning when a path turns bad or its reason changes, debug
while it stays the same), ``<source>_poll_recovered``.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import time
from typing import Any, AsyncIterator, Callable, ClassVar, Optional

from ...notice import WatchEvent
from .base import Backoff
from .http import Fault, HttpWatcher

__all__ = ["PollingWatcher"]

# The path whose task is running: a fault reported deep inside a handler is charged to it.
_CURRENT_PATH: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("spotguard_poll_path", default=None)


class PollingWatcher(HttpWatcher):
    """Subclasses set ``_log`` (their module's logger) and implement ``_paths`` and ``_poll``."""

    _log: ClassVar[Any]

    def __init__(self, base_url: str, poll_interval: float, backoff: Callable[[], Backoff]) -> None:
        super().__init__()
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval}")
        self.base_url = base_url.rstrip("/")
        self.poll_interval = poll_interval
        self._new_backoff = backoff
        self._faults: dict[str, int] = {}
        self._reported: dict[str, str] = {}  # path -> reason last logged as a warning
        self._queue: asyncio.Queue[Optional[WatchEvent]] = asyncio.Queue()
        # A notice must reach a health check well within this (a path polled every second that has
        # not answered well for this long is blind); a slow poll interval stretches it.
        self.health.stale_floor = 20 * poll_interval

    def _started_details(self) -> dict[str, Any]:
        """Extra fields for the ``<source>_watcher_started`` line."""
        return {}

    @abc.abstractmethod
    def _paths(self) -> list[str]:
        """The paths polled independently (one task each)."""

    @abc.abstractmethod
    async def _poll(self, path: str) -> Optional[list[WatchEvent]]:
        """One request for ``path``: its events, or None when the path is done (stop polling it).
        Raise ``Fault`` for a bad answer, or report softer faults through ``_error``."""

    def _error(self, fault: Fault, **extra: Any) -> None:
        """Count and log one fault of the current path; that poll then counts as failed."""
        path = extra.pop("path", None) or _CURRENT_PATH.get()
        if path is not None:
            self._faults[path] = self._faults.get(path, 0) + 1
        self.health.error(fault.reason, fault.message, fault.fix, path=path)
        fields: dict[str, Any] = {"reason": fault.reason, "error": fault.message, "path": path, **extra}
        if fault.fix:
            fields["fix"] = fault.fix
        key = path or ""
        if self._reported.get(key) != fault.reason:
            self._reported[key] = fault.reason
            self._log.warning(f"{self.source}_poll_error", **fields)
        else:
            self._log.debug(f"{self.source}_poll_error", **fields)

    async def close(self) -> None:
        self._closed.set()
        self._queue.put_nowait(None)
        await self._close_session()

    async def events(self) -> AsyncIterator[WatchEvent]:
        """Poll every path on its own schedule until ``close``; yield what they find."""
        self._log.info(
            f"{self.source}_watcher_started",
            base_url=self.base_url,
            poll_interval=self.poll_interval,
            paths=self._paths(),
            **self._started_details(),
        )
        tasks = [asyncio.create_task(self._path_loop(p), name=f"{self.source}-poll{p}") for p in self._paths()]
        try:
            while not self._closed.is_set():
                event = await self._queue.get()
                if event is None or self._closed.is_set():
                    return
                yield event
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_session()

    async def _path_loop(self, path: str) -> None:
        _CURRENT_PATH.set(path)
        backoff = self._new_backoff()
        while not self._closed.is_set():
            started = time.monotonic()
            self._faults[path] = 0
            retry_after = 0.0
            try:
                found = await self._poll(path)
            except asyncio.CancelledError:
                raise
            except Fault as fault:
                retry_after = fault.retry_after
                self._error(fault)
                found = []
            except Exception as exc:  # a bug must not take the daemon down
                self.health.error("internal", repr(exc), path=path)
                self._faults[path] += 1
                self._log.exception(f"{self.source}_watcher_internal_error", path=path, error=repr(exc))
                found = []
            if found is None:
                return
            for event in found:
                self._queue.put_nowait(event)
            if self._faults[path] == 0:
                if self._reported.pop(path, None) is not None:
                    self._log.info(f"{self.source}_poll_recovered", path=path)
                self.health.ok(path)
                backoff.reset()
                delay = self.poll_interval - (time.monotonic() - started)
            else:
                delay = max(self.poll_interval, backoff.next_delay(), retry_after)
            await self._sleep(delay)
