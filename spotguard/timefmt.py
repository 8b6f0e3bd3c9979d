"""Time formats used on the wire and by the clouds.

The wire format is RFC 3339 UTC with milliseconds and a ``Z`` suffix (socket protocol v1).
AWS scheduled events and Azure use RFC 1123 dates; parse them here, once.
"""

from __future__ import annotations

import email.utils
from datetime import datetime, timezone

__all__ = ["utcnow", "to_rfc3339", "parse_rfc3339", "parse_rfc1123", "to_rfc1123"]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def to_rfc3339(dt: datetime) -> str:
    if dt.tzinfo is None:
        raise ValueError("naive datetime: spotguard times are always UTC-aware")
    dt = dt.astimezone(timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 timestamp; a missing offset is an error, not local time."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected an RFC 3339 time string, got {text!r}")
    s = text.strip()
    if s[-1:] in ("Z", "z"):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        raise ValueError(f"RFC 3339 time without a UTC offset: {text!r}")
    return dt.astimezone(timezone.utc)


def parse_rfc1123(text: str) -> datetime:
    """Parse ``Mon, 19 Sep 2016 18:29:47 GMT`` and AWS's ``21 Jan 2019 09:00:43 GMT``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected an RFC 1123 date, got {text!r}")
    try:
        dt = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"not an RFC 1123 date: {text!r}") from exc
    if dt is None:
        raise ValueError(f"not an RFC 1123 date: {text!r}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc)


def to_rfc1123(dt: datetime) -> str:
    return email.utils.format_datetime(dt.astimezone(timezone.utc), usegmt=True)
