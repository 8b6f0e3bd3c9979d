"""The tiny interface every notice source implements (the NTH ``pkg/monitor`` shape, in asyncio).

A watcher is an async iterator of ``Notice``/``Cancel`` records. It owns its own
retry policy and never raises out of ``events()`` for a bad response: it logs,
records the error in ``health`` and keeps watching, so one broken metadata
endpoint can never take the daemon down. The daemon de-duplicates by notice id,
so a watcher may yield the same notice again (e.g. after a restart of its loop).
"""

from __future__ import annotations

import abc
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar, Optional

from ...notice import Notice, WatchEvent

__all__ = ["Watcher", "WatcherHealth", "Backoff"]


@dataclass
class WatcherHealth:
    """Counters read by ``status`` and the Prometheus collector; written only by the watcher."""

    source: str
    healthy: bool = True
    polls: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    last_error: Optional[str] = None
    last_ok_monotonic: Optional[float] = None

    def ok(self) -> None:
        self.polls += 1
        self.healthy = True
        self.last_ok_monotonic = time.monotonic()

    def error(self, reason: str, message: str) -> None:
        """``reason`` is a short label for metrics (``http_503``, ``timeout``, ``bad_json``...)."""
        self.polls += 1
        self.errors += 1
        self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + 1
        self.healthy = False
        self.last_error = message

    def to_dict(self) -> dict[str, Any]:
        age = None if self.last_ok_monotonic is None else round(time.monotonic() - self.last_ok_monotonic, 3)
        return {
            "source": self.source,
            "healthy": self.healthy,
            "polls": self.polls,
            "errors": self.errors,
            "last_error": self.last_error,
            "seconds_since_ok": age,
        }


class Backoff:
    """Jittered exponential backoff ("full jitter"), reset on success."""

    def __init__(self, base: float = 0.2, cap: float = 10.0, rng: Optional[random.Random] = None) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng or random.Random()

    def reset(self) -> None:
        self.attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        return self._rng.uniform(ceiling / 2, ceiling)


class Watcher(abc.ABC):
    """One notice source. Subclasses set ``source`` and implement ``events``."""

    source: ClassVar[str]

    def __init__(self) -> None:
        self.health = WatcherHealth(source=self.source)

    @abc.abstractmethod
    def events(self) -> AsyncIterator[WatchEvent]:
        """Yield notices (and cancellations) forever; return only when ``close`` was called."""

    async def approve(self, notice: Notice) -> Optional[bool]:
        """Tell the provider the node is ready (Azure ``StartRequests``); most sources have nothing to do.

        Returns False when the provider did not take the approval (so the daemon
        does not log it as approved); never raises for a provider error."""
        return None

    async def close(self) -> None:
        """Release sockets/sessions."""
