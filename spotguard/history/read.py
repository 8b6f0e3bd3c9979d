"""Reading a job's history: every valid event in time order, and each skipped entry named with why.

Same trust rules as checkpoints: keys are validated before use, bodies are parsed by the one
parser (``record.py``), and a damaged, oversized or foreign object is data — skipped, named in
``History.skipped`` and in one warning — never an exception or a reason to stop reading.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from ..logs import get_logger
from ..storage.base import ObjectInfo, Storage
from .record import MAX_BYTES, PREFIX, BadEntry, Event, parse_key

__all__ = ["History", "read_history"]

#: entries read at most (a history is bounded by the writers; a store holding more is not a history)
MAX_ENTRIES = 200_000


@dataclass
class History:
    """The events (sorted by time, then writer order) and the entries skipped: ``(key, why)``."""

    events: list[Event] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _read_local(folder: str, name: str) -> bytes:
    """A local entry's bytes: never through a link, never from a FIFO or device (the store's own read rules)."""
    fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadEntry("not a regular file")
        return os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)


def _read_one(storage: Storage, info: ObjectInfo, folder: Optional[str]) -> tuple[Optional[Event], Optional[str]]:
    try:
        _, run, rank, _ = parse_key(info.key)  # the key is checked before it names anything to read
        if info.size > MAX_BYTES:
            raise BadEntry(f"{info.size} bytes (at most {MAX_BYTES})")
        data = _read_local(folder, info.key[len(PREFIX):]) if folder else storage.read_bytes(info.key)
        ev = Event.from_json(data)
        if (ev.run, ev.rank) != (run, rank):
            raise BadEntry(f"its body names run {ev.run} rank {ev.rank}, its key run {run} rank {rank}")
        return ev, None
    except BadEntry as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a read that fails is a skipped entry, named
        return None, f"unreadable: {type(exc).__name__}: {exc}"[:300]


def read_history(storage: Storage, log: Any = None, threads: int = 8) -> History:
    """Every event under ``history/`` of ``storage``; damaged or foreign entries skipped with one warning."""
    out = History()
    infos = storage.list(PREFIX)
    if len(infos) > MAX_ENTRIES:
        out.skipped.append((PREFIX, f"{len(infos)} entries; reading the first {MAX_ENTRIES}"))
        infos = infos[:MAX_ENTRIES]
    root = storage.local_path("")
    folder = os.path.join(str(root), PREFIX.rstrip("/")) if root is not None else None
    if folder is not None or len(infos) < 64:  # a file read costs less than a thread hand-off
        results = [_read_one(storage, i, folder) for i in infos]
    else:  # an object store: one request per entry, several in flight, handed out in chunks
        chunks = [infos[k:k + 64] for k in range(0, len(infos), 64)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = [r for part in pool.map(lambda c: [_read_one(storage, i, None) for i in c], chunks)
                       for r in part]
    for info, (ev, why) in zip(infos, results):
        if ev is not None:
            out.events.append(ev)
        else:
            out.skipped.append((info.key, why or "?"))
    out.events.sort(key=lambda e: (e.time, e.run, e.rank, int(e.fields.get("seq", 0) or 0)))
    if out.skipped:
        (log or get_logger("spotguard.history")).warning(
            "history entries skipped", count=len(out.skipped),
            entries=[f"{k}: {w}" for k, w in out.skipped[:20]],
            detail="damaged or foreign objects under history/ are left as they are and not counted")
    return out
