"""The notice book: which notices are active, and what each subscriber said about each.

Pure bookkeeping with no I/O, so the rules (de-dup by id, cancel, expiry, Azure
approval, "every subscriber is done") are unit-testable without sockets.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from ..notice import EMERGENCY_KINDS, Notice
from ..protocol import Ack, CheckpointDone, CheckpointFailed, CheckpointStarted, Message
from ..timefmt import to_rfc3339, utcnow

__all__ = ["NoticeBook", "Entry", "Report", "STATES"]

# Per-subscriber progress on one notice, in order; a report never moves a state back.
STATES = ("queued", "delivered", "acked", "checkpoint_started", "checkpoint_done", "checkpoint_failed")
_RANK = {s: i for i, s in enumerate(STATES)}
FINAL_STATES = frozenset({"checkpoint_done", "checkpoint_failed"})


@dataclass
class Report:
    state: str = "queued"
    latency: Optional[float] = None
    step: Optional[int] = None
    uri: Optional[str] = None
    bytes: Optional[int] = None
    seconds: Optional[float] = None
    error: Optional[str] = None
    late: Optional[bool] = None  # checkpoint_done after the notice's deadline (seconds_past beside it)
    seconds_past: Optional[float] = None
    updated_monotonic: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "updated_monotonic"}


@dataclass
class Entry:
    notice: Notice
    watcher: Any = None
    seen_monotonic: float = field(default_factory=time.monotonic)
    reports: dict[int, Report] = field(default_factory=dict)
    # Subscribers a live broadcast is still being written to (for the "delivered to N" log line).
    pending: set[int] = field(default_factory=set)
    broadcast_to: int = 0
    latencies: list[float] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    approved: bool = False
    # When the notice stops being replayed, on the monotonic clock: the deadline as it stood when
    # the notice was seen, plus the margin. A wall-clock jump (NTP step, VM resume) moves neither.
    expires_monotonic: float = float("inf")

    @property
    def id(self) -> str:
        return self.notice.id


class NoticeBook:
    """Active notices keyed by id, with bounded memory of ids already seen."""

    def __init__(self, expire_margin: float = 60.0, remember: int = 4096) -> None:
        self.expire_margin = expire_margin
        self.remember = remember
        self.active: "OrderedDict[str, Entry]" = OrderedDict()
        self._seen: "OrderedDict[str, None]" = OrderedDict()
        self.last: Optional[Notice] = None
        self.total = 0
        self._finished_clients: set[int] = set()

    # --- notices -------------------------------------------------------------

    def add(self, notice: Notice, watcher: Any = None) -> Optional[Entry]:
        """Record a notice; ``None`` if its id was seen before (a re-poll: send nothing)."""
        if notice.id in self._seen:
            self._seen.move_to_end(notice.id)
            return None
        self._seen[notice.id] = None
        while len(self._seen) > self.remember:
            self._seen.popitem(last=False)
        entry = Entry(notice=notice, watcher=watcher)
        # A drill's deadline is invented: nothing happens after it, so it must not hold the node (and
        # make every restarted job exit) for a margin. A cloud deadline is approximate: keep the margin.
        margin = 0.0 if notice.source == "drill" else self.expire_margin
        entry.expires_monotonic = entry.seen_monotonic + notice.seconds_left() + margin
        self.active[notice.id] = entry
        self.last = notice
        self.total += 1
        return entry

    def seen(self, notice_id: str) -> bool:
        """Was this id ever added in this daemon life (within the last ``remember`` ids)?"""
        return notice_id in self._seen

    def cancel(self, notice_id: str) -> Optional[Entry]:
        """Withdraw an active notice; ``None`` if it is not active (nothing to send)."""
        return self.active.pop(notice_id, None)

    def get(self, notice_id: str) -> Optional[Entry]:
        return self.active.get(notice_id)

    def notices(self) -> list[Notice]:
        return [e.notice for e in self.active.values()]

    def expire(self, now: Optional[datetime] = None) -> list[Entry]:
        """Drop notices whose deadline passed more than ``expire_margin`` ago (the VM survived).

        Drills go at their deadline (no margin: see ``add``).

        Measured on the monotonic clock from when each notice was seen, so a wall-clock
        jump neither expires a live notice early nor keeps a dead one forever. ``now``
        (tests) means "as if the wall clock read ``now``": its offset from the present.
        """
        mono = time.monotonic()
        if now is not None:
            mono += (now - utcnow()).total_seconds()
        gone = [e for e in self.active.values() if e.expires_monotonic < mono]
        for e in gone:
            del self.active[e.id]
        return gone

    # --- delivery ------------------------------------------------------------

    def queued(self, notice_id: str, client_id: int, live: bool) -> None:
        entry = self.active.get(notice_id)
        if entry is None:
            return
        entry.reports.setdefault(client_id, Report())
        if live:
            entry.pending.add(client_id)

    def begin_broadcast(self, notice_id: str, count: int) -> None:
        entry = self.active.get(notice_id)
        if entry is not None:
            entry.broadcast_to = count

    def delivered(self, notice_id: str, client_id: int, latency: Optional[float]) -> Optional[Entry]:
        """Mark a write complete; returns the entry when its live broadcast just finished."""
        entry = self.active.get(notice_id)
        if entry is None:
            return None
        rep = entry.reports.setdefault(client_id, Report())
        if _RANK[rep.state] < _RANK["delivered"]:
            rep.state = "delivered"
            rep.updated_monotonic = time.monotonic()
        if client_id in entry.pending:
            rep.latency = latency
            if latency is not None:
                entry.latencies.append(latency)
            entry.pending.discard(client_id)
            if not entry.pending:
                return entry
        return None

    def client_gone(self, client_id: int) -> list[Entry]:
        """A subscriber disconnected: returns entries whose live broadcast it was the last one of."""
        finished = []
        for entry in self.active.values():
            if client_id in entry.reports:
                entry.gone.add(client_id)
            if client_id in entry.pending:
                entry.pending.discard(client_id)
                if not entry.pending:
                    finished.append(entry)
        return finished

    # --- reports -------------------------------------------------------------

    def record(self, client_id: int, msg: Message) -> tuple[Optional[Entry], bool]:
        """Apply ack/checkpoint_*; returns (entry, changed). Unknown ids are ignored."""
        notice_id = getattr(msg, "id", "")
        entry = self.active.get(notice_id)
        if entry is None:
            return None, False
        rep = entry.reports.setdefault(client_id, Report())
        state = {Ack: "acked", CheckpointStarted: "checkpoint_started", CheckpointDone: "checkpoint_done",
                 CheckpointFailed: "checkpoint_failed"}.get(type(msg))
        if state is None:
            return entry, False
        if rep.state in FINAL_STATES or _RANK[state] < _RANK[rep.state]:
            return entry, False
        rep.state = state
        rep.updated_monotonic = time.monotonic()
        if isinstance(msg, CheckpointStarted):
            rep.step = msg.step
        elif isinstance(msg, CheckpointDone):
            rep.step, rep.uri, rep.bytes, rep.seconds = msg.step, msg.uri, msg.bytes, msg.seconds
            if msg.late:
                rep.late, rep.seconds_past = True, msg.seconds_past
        elif isinstance(msg, CheckpointFailed):
            rep.error = msg.error
        if state in FINAL_STATES and entry.notice.kind in EMERGENCY_KINDS:
            self._finished_clients.add(client_id)
        return entry, True

    def client_finished(self, client_id: int) -> bool:
        """Did this subscriber report checkpoint_done/failed for any emergency notice?"""
        return client_id in self._finished_clients

    def ready_for_approval(self, entry: Entry) -> bool:
        """Every subscriber the notice went to reported ``checkpoint_done`` (and none failed).

        Conservative on purpose: approval starts the event for every VM listed
        in ``Resources``, so a subscriber that vanished without reporting, or a
        failure, leaves the event to start at its own ``NotBefore``.
        """
        if entry.approved or not entry.reports:
            return False
        return all(r.state == "checkpoint_done" for r in entry.reports.values())

    # --- views ---------------------------------------------------------------

    def snapshot(self, compact: bool = False) -> list[dict[str, Any]]:
        """Active notices with per-subscriber states (``compact``: counts per state, no detail)."""
        out = []
        for e in self.active.values():
            item: dict[str, Any] = {**e.notice.to_wire(), "seconds_left": round(e.notice.seconds_left(), 3),
                                    "expires_in": round(max(0.0, e.expires_monotonic - time.monotonic()), 3),
                                    "approved": e.approved}
            if compact:
                item["detail"] = item["detail"][:200]
                counts: dict[str, int] = {}
                for r in e.reports.values():
                    counts[r.state] = counts.get(r.state, 0) + 1
                item["subscriber_states"] = counts
            else:
                item["subscribers"] = {str(cid): r.to_dict() for cid, r in e.reports.items()}
            out.append(item)
        return out

    @staticmethod
    def wire_time(dt: datetime) -> str:
        return to_rfc3339(dt)
