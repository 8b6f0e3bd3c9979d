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
class _PathHealth:
    """One metadata path: its last answer, when it last answered well, and what went wrong."""

    ok: bool = False
    last_ok_monotonic: Optional[float] = None
    last_error: Optional[str] = None
    fix: Optional[str] = None


@dataclass
class WatcherHealth:
    """Counters read by ``status``, ``/healthz`` and the Prometheus collector; written only by the watcher.

    ``healthy`` is the state of the last answers. ``problem()`` is what health checks use (None:
    sees notices): a metadata watcher (``expects_answers``) sees notices only once every path it
    ``require``d has had a good answer, and only while none has gone ``stale_after`` seconds
    (at least ``stale_floor``) without one. A 404
    where a notice path must exist (GKE's metadata server under Workload Identity) or a token PUT
    that never returns (EKS hop limit) is a watcher that answers nothing: blind, and said so.
    """

    source: str
    healthy: bool = True
    polls: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    last_error: Optional[str] = None
    last_fix: Optional[str] = None
    last_ok_monotonic: Optional[float] = None
    expects_answers: bool = False
    stale_after: float = 120.0  # the operator's choice (--health-stale-after)
    stale_floor: float = 0.0  # the watcher's own minimum (a GCP hanging GET answers only every wait_timeout_sec)
    paths: dict[str, _PathHealth] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)

    def require(self, *paths: str) -> None:
        """Paths that must answer well for the watcher to count as seeing notices."""
        self.expects_answers = True
        for p in paths:
            self.required.add(p)
            self.paths.setdefault(p, _PathHealth())

    def release(self, path: str) -> None:
        """A path no longer needed (Azure's VM name, once known)."""
        self.required.discard(path)
        self.paths.pop(path, None)
        self._recompute()

    def _recompute(self) -> None:
        if self.paths:
            self.healthy = all(p.ok for name, p in self.paths.items() if name in self.required or not self.required)

    def ok(self, path: Optional[str] = None) -> None:
        self.polls += 1
        now = time.monotonic()
        if path is None:
            self.healthy = True
        else:
            ph = self.paths.setdefault(path, _PathHealth())
            ph.ok, ph.last_ok_monotonic = True, now
            self._recompute()
        if self.healthy:
            self.last_ok_monotonic = now

    def error(self, reason: str, message: str, fix: Optional[str] = None, path: Optional[str] = None) -> None:
        """``reason`` is a short label for metrics (``http_503``, ``timeout``, ``bad_json``...)."""
        self.polls += 1
        self.errors += 1
        self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + 1
        self.healthy = False
        self.last_error = message
        self.last_fix = fix
        if path is not None:
            ph = self.paths.setdefault(path, _PathHealth())
            ph.ok, ph.last_error, ph.fix = False, message, fix

    def problem(self, now: Optional[float] = None) -> Optional[str]:
        """Why this watcher cannot see notices (each blind path with its fix, ``; ``-joined), or None."""
        if not self.expects_answers:
            return None
        now = time.monotonic() if now is None else now
        out: list[str] = []
        for name in sorted(self.required):
            ph = self.paths.get(name) or _PathHealth()
            why = f": {ph.last_error}" if ph.last_error else ""
            fix = f" (fix: {ph.fix})" if ph.fix else ""
            if ph.last_ok_monotonic is None:
                out.append(f"{self.source} {name}: no good answer yet{why}{fix}")
                continue
            age = now - ph.last_ok_monotonic
            if age > max(self.stale_after, self.stale_floor):
                out.append(f"{self.source} {name}: no good answer for {age:.0f}s{why}{fix}")
        return "; ".join(out) or None

    def seeing(self) -> bool:
        return self.problem() is None

    def to_dict(self) -> dict[str, Any]:
        age = None if self.last_ok_monotonic is None else round(time.monotonic() - self.last_ok_monotonic, 3)
        problem = self.problem()
        return {
            "source": self.source,
            "healthy": self.healthy,
            "seeing_notices": problem is None,
            "problem": problem,
            "polls": self.polls,
            "errors": self.errors,
            "last_error": self.last_error,
            "fix": self.last_fix,
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
