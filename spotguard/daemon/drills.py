"""``spotguard drill`` on the daemon's side: who may ask (root or the daemon's uid, from SO_PEERCRED), the
synthetic notice it becomes, and ``drill --cancel``. The daemon ingests what these return like any notice."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Optional

from ..logs import get_logger
from ..notice import KINDS, Cancel, Notice
from ..protocol import Drill, DrillCancel, DrillOk, ErrorReply, Message
from ..timefmt import to_rfc3339, utcnow
from .book import NoticeBook
from .server import Client, drill_allowed

__all__ = ["MAX_DRILL_DEADLINE", "drill", "cancel"]

log = get_logger("spotguard.daemon")

MAX_DRILL_DEADLINE = 24 * 3600.0


def _refusal(client: Client, uid: int) -> Optional[Message]:
    if drill_allowed(client.peer, uid):
        return None
    peer_uid = None if client.peer is None else client.peer.uid
    log.warning("drill.refused", peer_uid_allowed=False, daemon_uid=uid, **client.log_fields())
    return ErrorReply(error=f"drill refused: peer uid {peer_uid} is neither root nor the daemon's uid "
                            f"{uid}; run `spotguard drill` as root or as uid {uid}")


def cancel(client: Client, msg: DrillCancel, uid: int, book: NoticeBook) -> tuple[Message, Optional[Cancel]]:
    """The reply, and the ``Cancel`` to ingest when the active drill ``msg.id`` may be withdrawn."""
    refused = _refusal(client, uid)
    if refused is not None:
        return refused, None
    entry = book.get(msg.id)
    if entry is None or entry.notice.source != "drill":
        active = [e.id for e in book.active.values() if e.notice.source == "drill"]
        return ErrorReply(error=f"no active drill {msg.id!r} (active drills: {', '.join(active) or 'none'}); "
                                "`spotguard status` lists them"), None
    log.info("drill.cancel_requested", notice_id=msg.id, **client.log_fields())
    return (DrillOk(id=msg.id, deadline=to_rfc3339(entry.notice.deadline)),
            Cancel(id=msg.id, source="drill", detail="cancelled with spotguard drill --cancel"))


def drill(client: Client, msg: Drill, uid: int) -> tuple[Message, Optional[Notice]]:
    """The reply, and the drill notice to ingest when the request is allowed and well-formed."""
    refused = _refusal(client, uid)
    if refused is not None:
        return refused, None
    if msg.kind not in KINDS:
        return ErrorReply(error=f"drill refused: unknown kind {msg.kind!r} (one of {', '.join(KINDS)})"), None
    if not 0 < msg.deadline_in <= MAX_DRILL_DEADLINE:
        return ErrorReply(error=f"drill refused: deadline_in must be in (0, {MAX_DRILL_DEADLINE:g}] seconds"), None
    now = utcnow()
    peer = client.peer
    notice = Notice(
        id=f"drill-{uuid.uuid4().hex[:16]}", source="drill", kind=msg.kind,
        deadline=now + timedelta(seconds=msg.deadline_in), received_at=now,
        detail=f"drill requested by pid {peer.pid if peer else '?'} uid {peer.uid if peer else '?'}",
    )
    log.info("drill.accepted", notice_id=notice.id, kind=msg.kind, deadline_in=msg.deadline_in,
             **client.log_fields())
    return DrillOk(id=notice.id, deadline=to_rfc3339(notice.deadline)), notice
