"""A subscriber's reports on the notices (ack, checkpoint_started / done / failed): recorded in the book,
logged, counted, handed to the cluster actions; with the two rules that make one checkpoint stand for
several notices (the same report for sibling emergency notices; a final report for an id an earlier,
killed daemon life delivered) and Azure's approval once every subscriber reported.

Why apart from ``noticeloop.py``: this is what the daemon learns back from the trainers, after the fan-out; it owns
the one piece of state it needs (the earlier-life reports per client) and is told the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Coroutine

from ..logs import get_logger
from ..notice import EMERGENCY_KINDS
from ..protocol import CheckpointDone, CheckpointFailed, CheckpointStarted, Message
from .actions import EARLIER_WINDOW, ActionRunner
from .book import Entry, NoticeBook
from .config import DaemonConfig
from .metrics import Metrics
from .server import Client
from .watchers.base import Watcher

__all__ = ["Reports"]

log = get_logger("spotguard.daemon")


class Reports:
    """The daemon's handler for reports; ``progress`` is set whenever one may end a wait for the trainers."""

    def __init__(self, book: NoticeBook, actions: ActionRunner, metrics: Metrics, config: DaemonConfig,
                 progress: asyncio.Event, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.book = book
        self.actions = actions
        self.metrics = metrics
        self.config = config
        self._progress = progress
        self._spawn_task = spawn
        # Per connected client: its final report for an id this life never saw, and when (_earlier_life_report).
        self._earlier_final: dict[int, tuple[float, Message]] = {}

    def sent(self, entry: Entry, clients: list[Client]) -> None:
        """A new notice went out to ``clients``: one that already reported for an earlier life's id of (maybe)
        this notice has that report count for it too."""
        for c in clients:
            at, earlier = self._earlier_final.get(c.id, (0.0, None))
            if earlier is not None and entry.seen_monotonic - at < EARLIER_WINDOW:
                self._record_earlier(c, earlier, [entry])

    def forget(self, client: Client) -> None:
        self._earlier_final.pop(client.id, None)

    def on_report(self, client: Client, msg: Message) -> None:
        """One subscriber report (ack, checkpoint_started/done/failed): book, log, metrics, actions."""
        entry, changed = self.book.record(client.id, msg)
        nid = getattr(msg, "id", "")
        if entry is None:
            if isinstance(msg, (CheckpointDone, CheckpointFailed)) and nid and not self.book.seen(nid) \
                    and self.actions.from_killed_life(client):
                self._earlier_life_report(client, msg)
                return
            log.info("report.unknown_notice", notice_id=nid, message_type=msg.type, **client.log_fields())
            return
        if not changed:
            return
        fields: dict[str, Any] = {}
        if isinstance(msg, CheckpointStarted):
            fields = {"step": msg.step}
        elif isinstance(msg, CheckpointDone):
            fields = {"step": msg.step, "uri": msg.uri, "bytes": msg.bytes, "seconds": msg.seconds}
            if msg.late:
                fields.update(late=True, seconds_past=msg.seconds_past)
                log.warning("notice.checkpoint_late", notice_id=nid, step=msg.step, seconds_past=msg.seconds_past,
                            why="committed after the notice's deadline: it would not have survived a real notice",
                            **client.log_fields())
            if msg.seconds >= 0:
                self.metrics.checkpoint_seconds.observe(msg.seconds)
            if msg.bytes >= 0:
                self.metrics.checkpoint_bytes.observe(msg.bytes)
        elif isinstance(msg, CheckpointFailed):
            fields = {"error": msg.error[:500]}
            self.metrics.checkpoint_failures.inc()
        event = "notice.acked" if msg.type == "ack" else f"notice.{msg.type}"
        log.info(event, notice_id=nid, seconds_left=round(entry.notice.seconds_left(), 3), **fields,
                 **client.log_fields())
        if self.config.azure_ack_after_checkpoint and self.book.ready_for_approval(entry):
            entry.approved = True
            self._spawn_task(self._approve(entry))
        touched = [entry, *self._same_report_for_siblings(client, msg, entry)]
        self.actions.progress(touched)
        self._progress.set()

    def _earlier_life_report(self, client: Client, msg: Message) -> None:
        """A final report for an id this life never saw: the id an earlier daemon life delivered before it was
        killed, before the state file had the notice (the same provider notice has a new id here). The trainer
        checkpointed once, for that id: its report stands for the emergency notices this life sent it, and for
        it in those seen soon (``ActionRunner.earlier_report``). Before: dropped, and the new id ended
        ``incomplete`` when the trainer left (daemon chaos, kill -9 before delivery)."""
        log.info("report.earlier_life_notice", notice_id=getattr(msg, "id", ""), message_type=msg.type,
                 detail="an id this daemon life never saw: delivered by a daemon killed before it wrote it down",
                 **client.log_fields())
        self._earlier_final[client.id] = (time.monotonic(), msg)
        touched = self._record_earlier(client, msg, [e for e in self.book.active.values() if e.id in client.sent_ids])
        state = "checkpoint_done" if isinstance(msg, CheckpointDone) else "checkpoint_failed"
        self.actions.earlier_report(client, state, step=getattr(msg, "step", None), uri=getattr(msg, "uri", None),
                                    error=getattr(msg, "error", None),
                                    seconds_past=getattr(msg, "seconds_past", None) if getattr(msg, "late", False)
                                    else None)
        if touched:
            self.actions.progress(touched)
        self._progress.set()

    def _record_earlier(self, client: Client, msg: Message, entries: list[Entry]) -> list[Entry]:
        out = []
        for e in entries:
            if e.notice.kind not in EMERGENCY_KINDS:
                continue
            got, changed = self.book.record(client.id, dataclasses.replace(msg, id=e.id))
            if got is not None and changed:
                log.info(f"notice.{msg.type}", notice_id=e.id, same_as=getattr(msg, "id", ""), earlier_life=True,
                         **client.log_fields())
                out.append(got)
        return out

    def _same_report_for_siblings(self, client: Client, msg: Message, entry: Any) -> list[Any]:
        """A trainer's final report on one emergency notice stands for every other emergency notice it was sent:
        the hook checkpoints once and reports for the notice it acted on, and a spot interruption inside an ASG
        is two notices (instance-action and target-lifecycle-state) — the other one must not end ``incomplete``."""
        if not isinstance(msg, (CheckpointDone, CheckpointFailed)) or entry.notice.kind not in EMERGENCY_KINDS:
            return []
        out = []
        for other in list(self.book.active.values()):
            if other is entry or other.notice.kind not in EMERGENCY_KINDS or other.id not in client.sent_ids:
                continue
            got, changed = self.book.record(client.id, dataclasses.replace(msg, id=other.id))
            if got is not None and changed:
                log.info(f"notice.{msg.type}", notice_id=other.id, same_as=entry.id, **client.log_fields())
                out.append(got)
        return out

    async def _approve(self, entry: Entry) -> None:
        w = entry.watcher
        if w is None or type(w).approve is Watcher.approve:
            return  # only sources with an approval step (Azure StartRequests)
        log.info("notice.approving", notice_id=entry.id, source=entry.notice.source,
                 subscribers=len(entry.reports))
        try:
            ok = await w.approve(entry.notice)
        except Exception as exc:
            ok, error = False, repr(exc)
        else:
            error = "the provider did not accept the approval (see the watcher's log line)"
        if ok is False:
            # The event then starts at its own NotBefore; a later report may retry.
            log.error("notice.approve_failed", notice_id=entry.id, source=entry.notice.source, error=error)
            entry.approved = False
            return
        log.info("notice.approved", notice_id=entry.id, source=entry.notice.source)
