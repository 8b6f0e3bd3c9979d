"""One history event: what the hook writes beside the checkpoints, and the only parser of it.

Why one small object per event (``history/<time>-<run>-<rank>-<seq>.json``): every
backend has whole-object writes, none has appends; a key that sorts by time makes a
listing the timeline. A stored entry is untrusted input like a checkpoint: its key and
body are validated, and anything else under ``history/`` is foreign (the reader skips
it and names it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..storage.base import check_key

__all__ = ["VERSION", "PREFIX", "MAX_BYTES", "KINDS", "Event", "BadEntry", "event_key", "parse_key"]

VERSION = 1
PREFIX = "history/"
#: one encoded event at most (a longer one has its longest strings cut, then its fields dropped)
MAX_BYTES = 4096
_MAX_STR = 300
_MAX_LIST = 32
_NAME = re.compile(r"^(\d{16})-([0-9a-f]{12})-(\d{5})-(\d{6})\.json$")
_RUN = re.compile(r"^[0-9a-f]{12}$")

#: the hook's log events (``spotguard/hook/events.py``, ``periodic.py``, ``torchft.py``) kept in the history
KINDS: frozenset[str] = frozenset({
    "hook_installed", "resumed", "notice_seen", "notice_cancelled", "agreed", "checkpoint_started",
    "checkpoint_committed", "checkpoint_failed", "checkpoint_late", "checkpoint_skipped", "periodic_committed",
    "periodic_failed", "peers_lost", "exit", "replica_leaving", "replica_left", "replica_all_leaving",
    "replica_heal_state",
    "alive",  # the writer's own: one object per process, rewritten (a process killed -9 leaves its progress)
})


class BadEntry(ValueError):
    """A stored history object that is not a valid event of this version (damaged or foreign)."""


def event_key(time_s: float, run: str, rank: int, seq: int) -> str:
    """The object key of one event: sorts by time, unique per (process run, rank, sequence number)."""
    return check_key(f"{PREFIX}{int(time_s * 1e6):016d}-{run}-{rank:05d}-{seq:06d}.json")


def parse_key(key: str) -> tuple[int, str, int, int]:
    """(time µs, run, rank, seq) of a history key; ``BadEntry`` for any other name."""
    if not key.startswith(PREFIX):
        raise BadEntry(f"{key!r} is not under {PREFIX}")
    m = _NAME.match(key[len(PREFIX):])
    if m is None:
        raise BadEntry(f"{key!r} is not a history entry name (<16 digits>-<run>-<rank>-<seq>.json)")
    return int(m[1]), m[2], int(m[3]), int(m[4])


def _clean(value: Any, depth: int = 0) -> Any:
    """A JSON-safe, bounded copy of a log field (long strings cut, long lists cut, odd objects as text)."""
    if value is None or isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:_MAX_STR]
    if depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else list(value)
        return [_clean(v, depth + 1) for v in items[:_MAX_LIST]]
    if depth < 2 and isinstance(value, Mapping):
        return {str(k)[:_MAX_STR]: _clean(v, depth + 1) for k, v in list(value.items())[:_MAX_LIST]}
    return str(value)[:_MAX_STR]


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not a number JSON allows")


def _finite(text: str) -> float:
    """A JSON number as a float; ``1e999`` (inf to Python's parser) is no number a writer produces."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


@dataclass(frozen=True)
class Event:
    """One thing that happened to the job: ``kind`` (a hook event name), wall ``time`` (epoch s), who and what.

    ``run`` is one process's id (12 hex digits, new at each start), ``node`` its host name; ``fields``
    the event's own log fields.
    """

    kind: str
    time: float
    run: str
    rank: int
    node: str = ""
    local_rank: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The stored form, never over ``MAX_BYTES`` (fields are cut to fit)."""
        body: dict[str, Any] = {"v": VERSION, "kind": self.kind, "time": round(self.time, 6), "run": self.run,
                                "rank": self.rank, "local_rank": self.local_rank, "node": self.node[:_MAX_STR],
                                "fields": _clean(self.fields)}
        data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        if len(data) > MAX_BYTES:  # keep the numbers, drop what does not fit
            body["fields"] = {k: v for k, v in body["fields"].items() if not isinstance(v, (str, list, dict))}
            body["fields"]["truncated"] = True
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        return data

    @classmethod
    def from_json(cls, data: bytes | str) -> "Event":
        """Parse and validate a stored event; ``BadEntry`` naming the first problem."""
        if len(data) > MAX_BYTES:
            raise BadEntry(f"{len(data)} bytes (at most {MAX_BYTES})")
        try:
            d = json.loads(data, parse_constant=_reject, parse_float=_finite)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadEntry(f"not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise BadEntry("not a JSON object")
        if d.get("v") != VERSION:
            raise BadEntry(f"version {d.get('v')!r} (this spotguard reads {VERSION})")
        kind, t, run, rank = d.get("kind"), d.get("time"), d.get("run"), d.get("rank")
        local_rank, node, fields = d.get("local_rank", 0), d.get("node", ""), d.get("fields", {})
        if not isinstance(kind, str) or kind not in KINDS:
            raise BadEntry(f"unknown kind {kind!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e11:
            raise BadEntry(f"time {t!r} is not an epoch time")
        if not isinstance(run, str) or not _RUN.match(run):
            raise BadEntry(f"run {run!r} is not 12 hex digits")
        for name, val in (("rank", rank), ("local_rank", local_rank)):
            if isinstance(val, bool) or not isinstance(val, int) or not 0 <= val < 100000:
                raise BadEntry(f"{name} {val!r} is not a rank")
        if not isinstance(node, str) or not isinstance(fields, dict):
            raise BadEntry("node must be a string and fields an object")
        seq = fields.get("seq", 0)
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 10**9:
            raise BadEntry(f"seq {seq!r} is not a sequence number")
        return cls(kind=kind, time=float(t), run=run, rank=rank, node=node, local_rank=local_rank, fields=fields)
