"""The daemon's state file and what it restores: one owner for the notices an earlier daemon life left, the
ids a re-seen notice keeps, and the writes, which run off the delivery path.

Why its own object: the notice loop (``noticeloop.py``) only says "the active notices changed" (``save``) or
"write it before the outcome goes out" (``persist``); when and from which thread the file is written, and
what an earlier life's notice turns a fresh one into (``restored``), are decided here alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Callable, Optional

from ..logs import get_logger
from ..notice import Notice
from ..timefmt import to_rfc3339, utcnow
from .book import NoticeBook
from .persist import Key, NoticeState

if TYPE_CHECKING:
    from .actions import ActionRunner

__all__ = ["StateKeeper"]

log = get_logger("spotguard.daemon")


class StateKeeper:
    """Active notices (with their action state) survive a daemon restart with their ids."""

    def __init__(self, path: Optional[str], book: NoticeBook, *, expire_margin: float) -> None:
        self.state = NoticeState(path, expire_margin=expire_margin)
        self.book = book
        self.actions: Optional["ActionRunner"] = None  # attach(): the runner is built with this keeper's callbacks
        self.persisted: dict[Key, Notice] = {}
        self._aliases: dict[str, str] = {}  # a watcher's fresh id -> the persisted id of the same notice
        self._dirty = False
        self._writer: Optional[asyncio.Task[None]] = None
        # Set once the earlier life's state file was read: a trainer that reconnects before then (the socket is
        # bound first) must not have it overwritten unread (its subscriber list, with the trainers of a kill -9).
        self.loaded = False
        self.closed = False  # shutdown writes the final state itself (flush)
        self.subscribers_at_stop = 0

    def attach(self, actions: "ActionRunner") -> None:
        self.actions = actions

    # --- ids --------------------------------------------------------------------------

    def restored(self, notice: Notice) -> Notice:
        """The same provider notice seen before a daemon restart keeps its id, deadline and received_at."""
        alias = self._aliases.get(notice.id)
        if alias is not None:
            return dataclasses.replace(notice, id=alias)
        if not notice.key:
            return notice
        for entry in self.book.active.values():  # a watcher restarted in this daemon life
            if entry.notice.key == notice.key and entry.notice.source == notice.source:
                if entry.id != notice.id:
                    self._aliases[notice.id] = entry.id
                return dataclasses.replace(notice, id=entry.id, deadline=entry.notice.deadline,
                                           received_at=entry.notice.received_at)
        old = self.persisted.pop((notice.source, notice.key), None)
        if old is None or old.kind != notice.kind:
            return notice
        if old.id != notice.id:
            self._aliases[notice.id] = old.id
        log.info("notice.restored", notice_id=old.id, watcher_id=notice.id, source=notice.source, kind=notice.kind,
                 deadline=to_rfc3339(old.deadline), detail="seen before a daemon restart: same id and deadline")
        return dataclasses.replace(notice, id=old.id, deadline=old.deadline, received_at=old.received_at)

    def cancelled_id(self, notice_id: str) -> str:
        """The id a cancel from a watcher means (its notice may carry an earlier life's id); the alias goes."""
        return self._aliases.pop(notice_id, notice_id)

    def expired(self, notice_id: str) -> None:
        for alias in [a for a, nid in self._aliases.items() if nid == notice_id]:
            del self._aliases[alias]

    def _still_running(self, now: datetime) -> list[Notice]:
        """Restored notices not re-seen (yet) whose deadline (plus the book's margin) has not passed."""
        margin = timedelta(seconds=self.book.expire_margin)
        return [n for n in self.persisted.values() if n.deadline + margin >= now]

    def cluster_active_ids(self) -> set[str]:
        """Cloud emergency notices still active on this node: in the book, or restored from the state file and
        not yet re-seen nor expired (a restarted daemon keeps the cordon of a notice that is still running)."""
        ids = {e.id for e in self.book.active.values()
               if e.notice.emergency and e.notice.source in ("aws", "gcp", "azure")}
        ids.update(n.id for n in self._still_running(utcnow()) if n.emergency)
        return ids

    def last_restored_end(self) -> Optional[datetime]:
        """When the last restored emergency notice would expire (its deadline plus the book's margin)."""
        margin = timedelta(seconds=self.book.expire_margin)
        ends = [n.deadline + margin for n in self.persisted.values() if n.emergency]
        return max(ends) if ends else None

    # --- the file: written off the delivery path ---------------------------------------

    def _notices(self) -> list[Notice]:
        left = self._still_running(utcnow())  # not re-seen (yet)
        return [*(e.notice for e in self.book.active.values() if e.notice.key), *left]

    def load(self, then: Callable[[], None]) -> None:
        """Read the earlier life's file (only once the socket is ours: no live daemon uses it), run ``then``
        (the action runner takes its part), and from now on write changes."""
        self.persisted = self.state.load()
        then()
        self.loaded = True
        if self._dirty:
            self.save()

    def save(self) -> None:
        """The active notices (and their action state) changed: write the state file soon, from a worker
        thread, after the fan-out already queued has gone out. Never waits: a slow disk (SkyPilot keeps the
        socket under $HOME) must not stand between a notice and its subscribers."""
        self._dirty = True
        if self.closed or not self.loaded:
            return  # shutdown writes the final state itself (flush); before the load: load() writes it
        if self._writer is None or self._writer.done():
            try:
                self._writer = asyncio.get_running_loop().create_task(self._write(), name="spotguard-state-writer")
            except RuntimeError:  # no loop (a unit test calling ingest synchronously)
                self._write_now()

    async def _write(self) -> None:
        assert self.actions is not None
        await asyncio.sleep(0)  # the client writers queued by this fan-out run first
        while self._dirty:
            self._dirty = False
            data = self.state.encode(self._notices(), self.actions.states(), subscribed=self.actions.registry())
            if data is not None:
                await asyncio.to_thread(self.state.write, data)

    def _write_now(self) -> None:
        assert self.actions is not None
        self._dirty = False
        data = self.state.encode(self._notices(), self.actions.states(), subscribers=self.subscribers_at_stop)
        if data is not None:
            self.state.write(data)

    async def persist(self) -> None:
        """Write the state file now (off the loop) and return once it is on disk: before an outcome is sent."""
        self.save()
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.shield(writer)

    async def flush(self) -> None:
        """At shutdown: wait (bounded) for a write in flight, then write what is left inline."""
        if not self.loaded:
            return  # stopped before the earlier life's state file was read: leave it for the next life
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.wait([writer], timeout=2.0)
        if self._dirty or writer is not None or self.subscribers_at_stop:
            self._write_now()
