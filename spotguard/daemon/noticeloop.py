"""The daemon's notice loop: ``ingest`` (the one entry of every notice), the fan-out and replay to the
subscribers, the socket server's handler callbacks, and the ``--sigterm-notice`` wait for the trainers.

Why apart from ``app.py``: that module wires the daemon (builds and starts its parts, signals, housekeeping,
shutdown); this one is what happens to a notice and to a subscriber once everything runs. It is given the
parts it works on at construction and asks the wiring only what ``Wiring`` names (who this VM is, the
status reply, the systemd status line, a stop), so a change to the notice path is read here alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional, Protocol

from ..logs import get_logger
from ..notice import Cancel, Notice
from ..protocol import (
    VERSION,
    CancelMsg,
    Drill,
    DrillCancel,
    ErrorReply,
    Hello,
    Message,
    NoticeMsg,
    ProtocolError,
    StatusReply,
    encode,
)
from ..timefmt import to_rfc3339
from . import drills
from .actions import ActionRunner
from .book import Entry, NoticeBook
from .metrics import Metrics
from .reports import Reports
from .sdnotify import SdNotifier
from .server import Client, Server
from .statefile import StateKeeper
from .watchers.base import Watcher

__all__ = ["NoticeLoop", "Wiring"]

log = get_logger("spotguard.daemon")


def _fits(msg: Message) -> bool:
    try:
        encode(msg)
    except ProtocolError:
        return False
    return True


def _fit_line(notice: Notice) -> Notice:
    """A provider's raw ``detail`` may be huge: cut it so the notice fits one protocol line."""
    if _fits(NoticeMsg(notice=notice)):
        return notice
    return dataclasses.replace(notice, detail=notice.detail[:4096] + " [truncated]")


def _disconnect_label(reason: str) -> str:
    """Low-cardinality label for the disconnect counter."""
    r = reason.lower()
    for key, label in (("overflow", "slow_reader"), ("stalled", "slow_reader"), ("malformed", "malformed"),
                       ("too many", "limit"), ("evicted", "limit"), ("idle", "idle"),
                       ("shutting down", "shutdown")):
        if key in r:
            return label
    return "closed"


class Wiring(Protocol):
    """What the notice loop asks of the daemon's wiring (``app.Daemon``); known only once it started."""

    cloud: str

    def node(self) -> str: ...

    def sources(self) -> list[str]: ...

    def status(self, compact: bool = False) -> dict[str, Any]: ...

    def sd_status(self) -> str: ...

    def request_stop(self, code: int = 0) -> None: ...


@dataclasses.dataclass(eq=False, repr=False)
class NoticeLoop:
    """The server's ``Handler`` and the one ``ingest``; ``server`` is attached by the wiring once built."""

    wiring: Wiring
    book: NoticeBook
    keeper: StateKeeper
    actions: ActionRunner
    reports: Reports
    metrics: Metrics
    sd: SdNotifier
    progress: asyncio.Event  # a subscriber reported or left: re-check the shutdown condition
    uid: int
    server: Optional[Server] = None
    termination_task: Optional[asyncio.Task[None]] = None

    def ingest(self, event: Any, watcher: Optional[Watcher] = None) -> Optional[Entry]:
        """One event from a source: de-dup, record, fan out. Returns the new entry, if any."""
        assert self.server is not None
        if isinstance(event, Cancel):
            notice_id = self.keeper.cancelled_id(event.id)
            entry = self.book.cancel(notice_id)
            if entry is None:
                return None
            self.server.broadcast(CancelMsg(id=notice_id))
            log.info("notice.cancelled", notice_id=notice_id, source=event.source, detail=event.detail[:500])
            self.metrics.cancels.labels(event.source).inc()
            self.actions.cancelled(notice_id)
            self.keeper.save()
            self.progress.set()
            return None
        if not isinstance(event, Notice):
            log.warning("watcher.bad_event", source=getattr(watcher, "source", None), event_type=type(event).__name__)
            return None
        notice = self.keeper.restored(_fit_line(event))
        entry = self.book.add(notice, watcher)
        if entry is None:
            return None
        # Delivery first: nothing (a log line, a state file, a metric) may stand between a notice and its
        # subscribers.
        sent = self.server.broadcast(NoticeMsg(notice=notice), notice.id, notice.received_at.timestamp())
        for c in sent:
            self.book.queued(notice.id, c.id, live=True)
        entry.broadcast_to = len(sent)
        self.reports.sent(entry, sent)
        if notice.key:
            self.keeper.save()
        self.metrics.notices.labels(notice.source, notice.kind).inc()
        log.info("notice.seen", notice_id=notice.id, source=notice.source, kind=notice.kind,
                 deadline=to_rfc3339(notice.deadline), received_at=to_rfc3339(notice.received_at),
                 seconds_left=round(notice.seconds_left(), 3), detail=notice.detail[:500], subscribers=len(sent))
        if not sent:
            log.info("notice.delivered", notice_id=notice.id, subscribers=0,
                     detail="no subscriber yet; replayed to each one that subscribes before it expires")
        self.sd.status(self.wiring.sd_status())
        self.actions.notice(entry)  # after the fan-out was queued: an action never delays it
        if notice.source == "signal" and notice.kind == "termination" and self.termination_task is None:
            self.termination_task = asyncio.create_task(self._terminate(notice), name="spotguard-termination")
        return entry

    # --- shutdown on a SIGTERM notice (--sigterm-notice) ---------------------------

    def _unfinished(self) -> list[Client]:
        assert self.server is not None
        return [c for c in self.server.subscribers() if not self.book.client_finished(c.id)]

    async def _terminate(self, notice: Notice) -> None:
        """Serve until every subscriber reported checkpoint_done/failed (or left), or the deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, notice.seconds_left())
        log.info("shutdown.waiting", notice_id=notice.id, subscribers=len(self._unfinished()),
                 deadline=to_rfc3339(notice.deadline))
        while True:
            pending = self._unfinished()
            if not pending:
                reason = "every subscriber reported its checkpoint or left"
                break
            left = end - loop.time()
            if left <= 0:
                reason = "grace deadline reached"
                break
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), left)
            except asyncio.TimeoutError:
                pass
        log.info("shutdown.ready", notice_id=notice.id, reason=reason,
                 still_waiting_for=[c.describe() for c in pending])
        self.wiring.request_stop(0)

    # --- server handler ---------------------------------------------------------

    def hello(self) -> Hello:
        return Hello(version=VERSION, node=self.wiring.node(), cloud=self.wiring.cloud, sources=self.wiring.sources())

    def on_connect(self, client: Client) -> None:
        pass

    def on_subscribe(self, client: Client) -> None:
        assert self.server is not None
        self.metrics.subscribers.set(len(self.server.subscribers()))
        for entry in list(self.book.active.values()):
            if entry.id in client.sent_ids:
                continue
            if self.server.send(client, NoticeMsg(notice=entry.notice), entry.id, None):
                self.book.queued(entry.id, client.id, live=False)
                log.info("notice.replayed", notice_id=entry.id, **client.log_fields())
        self.actions.remember(client)
        self.progress.set()
        self.sd.status(self.wiring.sd_status())

    def on_report(self, client: Client, msg: Message) -> None:
        self.reports.on_report(client, msg)

    def on_status(self, client: Client) -> Message:
        reply = StatusReply(state=self.wiring.status())
        if _fits(reply):
            return reply
        # Hundreds of subscribers x notices can outgrow one 64 KiB line: summarise.
        reply = StatusReply(state=self.wiring.status(compact=True))
        return reply if _fits(reply) else ErrorReply(error="status too large for one line")

    def on_drill_cancel(self, client: Client, msg: DrillCancel) -> Message:
        """Withdraw an active drill: subscribers get ``cancel`` and it is no longer replayed."""
        reply, cancel = drills.cancel(client, msg, self.uid, self.book)
        if cancel is not None:
            self.ingest(cancel)
        return reply

    def on_drill(self, client: Client, msg: Drill) -> Message:
        reply, notice = drills.drill(client, msg, self.uid)
        if notice is not None:
            self.ingest(notice, None)
        return reply

    def on_delivered(self, client: Client, notice_id: str, latency: Optional[float]) -> None:
        entry = self.book.get(notice_id)
        live = entry is not None and client.id in entry.pending
        finished = self.book.delivered(notice_id, client.id, latency)
        if live and latency is not None:
            self.metrics.delivery_latency.observe(latency)
            log.debug("notice.delivered_to", notice_id=notice_id, latency_ms=round(latency * 1e3, 3),
                      **client.log_fields())
        if finished is not None:
            self._log_delivered(finished)

    def on_disconnect(self, client: Client, reason: str) -> None:
        assert self.server is not None
        self.metrics.subscribers.set(len(self.server.subscribers()))
        self.metrics.disconnects.labels(_disconnect_label(reason)).inc()
        for entry in self.book.client_gone(client.id):
            self._log_delivered(entry)
        self.reports.forget(client)
        self.actions.forget(client)
        self.actions.progress(self.book.active.values())
        self.progress.set()
        if client.subscribed:
            self.sd.status(self.wiring.sd_status())

    def _log_delivered(self, entry: Entry) -> None:
        lat = sorted(entry.latencies)
        fields: dict[str, Any] = {"subscribers": len(lat), "of": entry.broadcast_to}
        if lat:
            fields.update(latency_ms_p50=round(lat[len(lat) // 2] * 1e3, 3), latency_ms_max=round(lat[-1] * 1e3, 3))
        log.info("notice.delivered", notice_id=entry.id, source=entry.notice.source, kind=entry.notice.kind, **fields)
