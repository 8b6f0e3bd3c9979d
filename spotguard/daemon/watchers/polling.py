"""The poll loop shared by the AWS and Azure watchers.

``events`` runs one cycle (``_cycle``, the cloud's own requests), yields what it
found, then sleeps: the rest of ``poll_interval`` after a clean cycle, or at least
the jittered backoff (and any ``Retry-After``) after a faulty one. A bug inside a
cycle is logged and counted as an ``internal`` error, never raised. Log events are
named after the watcher's ``source``: ``<source>_watcher_started``,
``<source>_watcher_internal_error``, ``<source>_poll_error``, ``<source>_poll_recovered``.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar

from ...notice import WatchEvent
from .base import Backoff
from .http import Fault, HttpWatcher

__all__ = ["CycleResult", "PollingWatcher"]


@dataclass
class CycleResult:
    events: list[WatchEvent] = field(default_factory=list)
    ok: bool = True
    retry_after: float = 0.0


class PollingWatcher(HttpWatcher):
    """Subclasses set ``_log`` (their module's logger) and implement ``_cycle``."""

    _log: ClassVar[Any]

    def __init__(self, base_url: str, poll_interval: float, backoff: Backoff) -> None:
        super().__init__()
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval}")
        self.base_url = base_url.rstrip("/")
        self.poll_interval = poll_interval
        self._backoff = backoff
        self._cycle_faults = 0

    def _started_details(self) -> dict[str, Any]:
        """Extra fields for the ``<source>_watcher_started`` line."""
        return {}

    def _error(self, fault: Fault, **extra: Any) -> None:
        """Count and log one fault; a cycle with any fault is not ``ok``."""
        self._cycle_faults += 1
        self.health.error(fault.reason, fault.message)
        fields: dict[str, Any] = {"reason": fault.reason, "error": fault.message, **extra}
        if fault.fix:
            fields["fix"] = fault.fix
        self._log.warning(f"{self.source}_poll_error", **fields)

    async def events(self) -> AsyncIterator[WatchEvent]:
        """Poll every ``poll_interval`` (backing off on errors) until ``close``."""
        self._log.info(
            f"{self.source}_watcher_started",
            base_url=self.base_url,
            poll_interval=self.poll_interval,
            **self._started_details(),
        )
        try:
            while not self._closed.is_set():
                started = time.monotonic()
                try:
                    result = await self._checked_cycle()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a bug must not take the daemon down
                    self.health.error("internal", repr(exc))
                    self._log.exception(f"{self.source}_watcher_internal_error", error=repr(exc))
                    result = CycleResult(ok=False)
                for event in result.events:
                    if self._closed.is_set():
                        return
                    yield event
                if result.ok:
                    self._backoff.reset()
                    delay = self.poll_interval - (time.monotonic() - started)
                else:
                    delay = max(self.poll_interval, self._backoff.next_delay(), result.retry_after)
                await self._sleep(delay)
        finally:
            await self._close_session()

    async def _checked_cycle(self) -> CycleResult:
        """One ``_cycle``; it is ok unless it said otherwise or logged a fault through ``_error``."""
        result = CycleResult()
        was_healthy = self.health.healthy
        self._cycle_faults = 0
        await self._cycle(result)
        result.ok = result.ok and self._cycle_faults == 0
        if result.ok:
            self.health.ok()
            if not was_healthy:
                self._log.info(f"{self.source}_poll_recovered")
        return result

    @abc.abstractmethod
    async def _cycle(self, result: CycleResult) -> None:
        """Make one round of requests: add events to ``result``, report faults through ``_error``
        (raising ``result.retry_after`` where the answer asked for it), or set ``result.ok`` False."""
