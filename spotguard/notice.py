"""The one record every notice source yields, and the daemon and hook share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, Mapping, Union

from .timefmt import parse_rfc3339, to_rfc3339, utcnow

__all__ = [
    "Notice",
    "Cancel",
    "WatchEvent",
    "SOURCES",
    "KINDS",
    "EMERGENCY_KINDS",
    "stable_id",
]

Source = Literal["aws", "gcp", "azure", "signal", "drill"]
Kind = Literal["preemption", "rebalance", "maintenance", "termination"]

SOURCES: tuple[str, ...] = ("aws", "gcp", "azure", "signal", "drill")
KINDS: tuple[str, ...] = ("preemption", "rebalance", "maintenance", "termination")
# Kinds after which the VM is gone: the hook writes its emergency checkpoint and exits.
EMERGENCY_KINDS: frozenset[str] = frozenset({"preemption", "termination"})


def stable_id(source: str, *parts: object) -> str:
    """An id that stays the same across polls of one notice (content-derived)."""
    digest = hashlib.sha256("\x1f".join([source, *map(str, parts)]).encode()).hexdigest()
    return f"{source}-{digest[:16]}"


@dataclass(frozen=True)
class Notice:
    """A termination (or softer) notice, with the time the VM may disappear."""

    id: str
    source: str
    kind: str
    deadline: datetime
    received_at: datetime = field(default_factory=utcnow)
    detail: str = ""
    # What identifies this provider notice without first-seen parts (AWS spot: action + time;
    # GCP: path + value + ETag; Azure: EventId), set by the watcher. Daemon-internal: never
    # sent on the wire (``to_wire`` leaves it out), not part of equality. The daemon uses it
    # to give a notice re-detected after a daemon restart its earlier id and deadline.
    key: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown notice source {self.source!r} (one of {', '.join(SOURCES)})")
        if self.kind not in KINDS:
            raise ValueError(f"unknown notice kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("notice id must be a non-empty string")
        for name in ("deadline", "received_at"):
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise ValueError(f"notice {name} must be a UTC-aware datetime")

    @property
    def emergency(self) -> bool:
        return self.kind in EMERGENCY_KINDS

    def seconds_left(self, now: datetime | None = None) -> float:
        return (self.deadline - (now or utcnow())).total_seconds()

    def with_received(self, received_at: datetime) -> "Notice":
        return replace(self, received_at=received_at)

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "kind": self.kind,
            "deadline": to_rfc3339(self.deadline),
            "received_at": to_rfc3339(self.received_at),
            "detail": self.detail,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "Notice":
        try:
            detail = data.get("detail", "")
            return cls(
                id=data["id"],
                source=data["source"],
                kind=data["kind"],
                deadline=parse_rfc3339(data["deadline"]),
                received_at=parse_rfc3339(data["received_at"]),
                detail=detail if isinstance(detail, str) else str(detail),
            )
        except KeyError as exc:
            raise ValueError(f"notice is missing field {exc.args[0]!r}") from None


@dataclass(frozen=True)
class Cancel:
    """A notice withdrawn by its source (AWS scheduled event completed/canceled, Azure event gone)."""

    id: str
    source: str
    detail: str = ""


WatchEvent = Union[Notice, Cancel]
