"""What the daemon reports about itself: the ``status`` reply, health (``/healthz``, ``status --check``),
what ``wait-checkpoint`` waits for, and the systemd status line.

Why apart from ``app.py``: these only read the daemon's parts (``Observed`` names which), so they can be
read and changed without the notice loop or the wiring.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Protocol

from ..protocol import VERSION
from ..version import __version__
from .actions import ActionRunner
from .book import NoticeBook
from .config import DaemonConfig
from .metrics import Metrics
from .server import Server
from .supervise import WatcherSupervisor
from .watchers.base import Watcher

__all__ = ["Observed", "status", "health", "checkpoint_pending", "health_doc", "sd_status", "FAR_NOTICE"]

# Seconds: an emergency notice further off than this is not waited for by ``wait-checkpoint``
# until its checkpoint starts (the hook's default SPOTGUARD_EMERGENCY_LEAD).
FAR_NOTICE = 300.0


class Observed(Protocol):
    """The parts of the daemon (``app.Daemon``) these reports read."""

    config: DaemonConfig
    book: NoticeBook
    actions: ActionRunner
    metrics: Metrics
    supervisor: WatcherSupervisor
    watchers: list[Watcher]
    cloud: str
    uid: int
    started_monotonic: float
    shutting_down: Optional[str]

    @property
    def server(self) -> Optional[Server]: ...

    @property
    def stop_requested(self) -> bool: ...

    def node(self) -> str: ...

    def sources(self) -> list[str]: ...


def status(daemon: Observed, compact: bool = False) -> dict[str, Any]:
    """The ``status`` reply; ``compact`` lists at most 32 subscribers and counts states per notice."""
    server = daemon.server
    watchers = []
    for w in daemon.watchers:
        doc = dict(w.health.to_dict())
        doc["running"] = daemon.supervisor.running(w)
        doc["restarts"] = daemon.supervisor.restarts(w.source)
        watchers.append(doc)
    last = daemon.book.last
    subscribers = [] if server is None else [c.describe() for c in server.subscribers()]
    healthy, problems = health(daemon)
    return {
        "daemon_version": __version__,
        "protocol_version": VERSION,
        "node": daemon.node(),
        "cloud": daemon.cloud,
        "sources": daemon.sources(),
        "pid": os.getpid(),
        "uid": daemon.uid,
        "uptime_seconds": round(time.monotonic() - daemon.started_monotonic, 3),
        "socket": daemon.config.socket,
        "watchers": watchers,
        "subscribers": subscribers[:32] if compact else subscribers,
        "subscribers_total": len(subscribers),
        "clients": 0 if server is None else len(server.clients),
        "active_notices": daemon.book.snapshot(compact=compact),
        "last_notice": None if last is None else last.to_wire(),
        "notices_total": daemon.book.total,
        "azure_ack_after_checkpoint": daemon.config.azure_ack_after_checkpoint,
        "actions": [a.name for a in daemon.actions.actions],
        "sigterm_notice": daemon.config.sigterm_notice,
        "shutting_down": daemon.shutting_down,
        "healthy": healthy,
        "problems": problems,
        "checkpoint_pending": checkpoint_pending(daemon),
        "log_write_errors": daemon.metrics.log_write_errors(),
    }

def health(daemon: Observed) -> tuple[bool, list[str]]:
    """Healthy = serving the socket and every metadata watcher sees notices; else the problems,
    one line each with its fix (what /healthz and ``spotguard status --check`` report)."""
    problems: list[str] = []
    if not (daemon.server is not None and daemon.server.serving and not daemon.stop_requested):
        problems.append(f"not serving {daemon.config.socket}" + (" (shutting down)" if daemon.stop_requested else ""))
    for w in daemon.watchers:
        problem = w.health.problem()
        if problem is not None:
            problems.append(problem)
    return not problems, problems

def checkpoint_pending(daemon: Observed) -> dict[str, Any]:
    """For ``spotguard wait-checkpoint``: the active emergency notices, and the connected
    subscribers that have not reported ``checkpoint_done``/``checkpoint_failed`` for each."""
    notices = [e for e in daemon.book.active.values() if e.notice.emergency]
    waiting: list[dict[str, Any]] = []
    subs = [] if daemon.server is None else daemon.server.subscribers()
    for c in subs:
        late = []
        for e in notices:
            r = e.reports.get(c.id)
            state = "queued" if r is None else r.state
            if state in ("checkpoint_done", "checkpoint_failed"):
                continue
            # A far notice (a GCP GPU maintenance window an hour out) is not being checkpointed yet:
            # the hook keeps training until SPOTGUARD_EMERGENCY_LEAD before it. Wait only for one
            # that is near, or whose checkpoint has started.
            if state == "checkpoint_started" or e.notice.seconds_left() <= FAR_NOTICE:
                late.append(e.id)
        if late:
            waiting.append({**c.describe(), "notices": late})
    return {"notices": [e.id for e in notices], "count": len(waiting), "subscribers": waiting[:32]}

def health_doc(daemon: Observed) -> tuple[bool, dict[str, Any]]:
    """What ``/healthz`` answers."""
    ok, problems = health(daemon)
    return ok, {
        "socket": daemon.config.socket,
        "serving": daemon.server is not None and daemon.server.serving and not daemon.stop_requested,
        "cloud": daemon.cloud,
        "watchers": {w.source: w.health.healthy for w in daemon.watchers},
        "seeing_notices": {w.source: w.health.problem() is None for w in daemon.watchers},
        "problems": problems,
        "subscribers": 0 if daemon.server is None else len(daemon.server.subscribers()),
    }

def sd_status(daemon: Observed) -> str:
    """The one-line systemd STATUS."""
    subs = 0 if daemon.server is None else len(daemon.server.subscribers())
    return (f"cloud={daemon.cloud} subscribers={subs} active_notices={len(daemon.book.active)} "
            f"socket={daemon.config.socket}")
