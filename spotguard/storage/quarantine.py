"""Quarantine: the mark that sets a committed checkpoint aside once it failed verification.

Layout: ``step-00000042/QUARANTINE.json`` beside the folder's ``COMMIT.json``,
written through the ``Storage`` seam (one small object: every backend). Why a
mark and not a deletion: the damaged bytes are evidence the operator may want
(``spotguard checkpoints --restore`` re-verifies and lifts the mark after a
repair; ``--delete-quarantined`` removes them). Why a mark at all: without it a
committed-but-damaged checkpoint keeps counting as the newest one, so
retention deletes the good ones under it, a later save at its step is
"already committed", and every restart reads it in full before falling back.

The mark is untrusted data, like everything in storage. It only ever makes
resume *skip* a checkpoint, so a forged mark could hide a good one: it
therefore names the SHA-256 of the exact commit record it judged (a mark left
from another record, e.g. after the step was saved again, is stale and
ignored), and is signed with ``$SPOTGUARD_COMMIT_KEY`` when the job sets one
(a mark that does not check out under the key is ignored). A garbage or
stale mark is logged and ignored: resume then verifies the checkpoint in
full, which is always safe (it re-marks it if it is damaged).
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from ..logs import get_logger
from ..timefmt import parse_rfc3339, to_rfc3339, utcnow
from .base import Storage, join_key

__all__ = ["QUARANTINE_NAME", "MAX_MARK_BYTES", "QuarantineMark", "record_digest", "read_mark", "write_mark"]

QUARANTINE_NAME = "QUARANTINE.json"
MAX_MARK_BYTES = 64 * 1024  # a real mark is < 2 KiB; a bigger object is not read (garbage)
MARK_FORMAT = 1
_TEXT_LIMIT = 2000  # reason/where are cut to this many characters (they come from exception text)

log = get_logger("spotguard.storage")


def record_digest(raw: bytes) -> str:
    """SHA-256 (hex) of a commit record's bytes: binds a mark to the record it judged."""
    return hashlib.sha256(raw).hexdigest()


def _cut(text: Any) -> str:
    s = str(text)
    return s if len(s) <= _TEXT_LIMIT else s[:_TEXT_LIMIT] + "..."


@dataclass
class QuarantineMark:
    """Why a committed checkpoint was set aside, when, and by which check."""

    step: int
    record_sha256: str
    reason: str
    where: str = ""
    by: str = "resume"  # resume | latest | checkpoints --verify | checkpoints --restore
    at: str = field(default_factory=lambda: to_rfc3339(utcnow()))
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    format: int = MARK_FORMAT
    signature: str | None = None

    def _body(self) -> dict[str, Any]:
        return {"format": self.format, "step": self.step, "record_sha256": self.record_sha256,
                "reason": _cut(self.reason), "where": _cut(self.where), "by": _cut(self.by), "at": self.at,
                "host": _cut(self.host), "pid": self.pid}

    def sign(self, key: bytes | None) -> "QuarantineMark":
        self.signature = None if not key else _mac(key, self._body())
        return self

    def to_json(self) -> str:
        d = self._body()
        if self.signature is not None:
            d["hmac"] = self.signature
        return json.dumps(d, indent=2, allow_nan=False) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, raw: bytes) -> "QuarantineMark":
        """Parse and validate; any problem is a ValueError naming it."""
        if len(raw) > MAX_MARK_BYTES:
            raise ValueError(f"quarantine mark is {len(raw)} bytes (a real one is < {MAX_MARK_BYTES})")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"quarantine mark is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"quarantine mark must be a JSON object, got {type(data).__name__}")
        for name, kind in (("format", int), ("step", int), ("record_sha256", str), ("reason", str), ("at", str)):
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"quarantine mark field {name!r} must be a {kind.__name__}, got {v!r:.80}")
        if data["format"] != MARK_FORMAT:
            raise ValueError(f"quarantine mark format {data['format']} is not {MARK_FORMAT}")
        if data["step"] < 0:
            raise ValueError("quarantine mark step must be >= 0")
        sha = data["record_sha256"]
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError("quarantine mark record_sha256 is not a SHA-256 hex digest")
        try:
            parse_rfc3339(data["at"])
        except (ValueError, TypeError, OverflowError):
            raise ValueError(f"quarantine mark time {data['at']!r:.80} is not an RFC 3339 time") from None
        extra = {}
        for name in ("where", "by", "host"):
            v = data.get(name, "")
            if not isinstance(v, str):
                raise ValueError(f"quarantine mark field {name!r} must be a string")
            extra[name] = v
        pid = data.get("pid", 0)
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise ValueError("quarantine mark pid must be an integer")
        sig = data.get("hmac")
        if sig is not None and not isinstance(sig, str):
            raise ValueError("quarantine mark hmac must be a string")
        return cls(step=data["step"], record_sha256=sha, reason=_cut(data["reason"]), at=data["at"], pid=pid,
                   signature=sig, **{k: _cut(v) for k, v in extra.items()})

    def problem(self, step: int, record_raw: bytes, key: bytes | None) -> str | None:
        """Why this mark does not apply to ``step``'s current record (None: it does)."""
        if self.step != step:
            return f"the mark names step {self.step}"
        if self.record_sha256 != record_digest(record_raw):
            return "the mark was written for another commit record (stale: the step was saved again?)"
        if key:
            if self.signature is None:
                return "the mark is not signed but $SPOTGUARD_COMMIT_KEY is set"
            if not _hmac.compare_digest(self.signature, _mac(key, self._body())):
                return "the mark's signature does not match $SPOTGUARD_COMMIT_KEY (forged or altered)"
        return None

    def describe(self) -> str:
        """One line for listings: what failed, where, by which check, when."""
        where = f" in {self.where}" if self.where else ""
        return f"{self.reason}{where}; by {self.by} at {self.at}"


def _mac(key: bytes, body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return _hmac.new(key, b"quarantine\0" + text.encode("utf-8"), hashlib.sha256).hexdigest()


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def read_mark(storage: Storage, dirkey: str, step: int, record_raw: bytes, size: int | None,
              key: bytes | None) -> tuple[QuarantineMark | None, str | None]:
    """The mark in ``dirkey`` if it applies to its current record: ``(mark, None)`` or ``(None, why ignored)``.

    Never raises for bad content: a garbage, oversized, stale or unsigned mark is
    ignored (the caller logs why), so the checkpoint is verified in full again.
    """
    if size is not None and size > MAX_MARK_BYTES:
        return None, f"quarantine mark is {size} bytes (a real one is < {MAX_MARK_BYTES}); not read"
    try:
        raw = storage.read_bytes(join_key(dirkey, QUARANTINE_NAME))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"quarantine mark cannot be read: {exc}"
    try:
        mark = QuarantineMark.from_json(raw)
    except ValueError as exc:
        return None, f"garbage quarantine mark: {exc}"
    why = mark.problem(step, record_raw, key)
    return (None, why) if why else (mark, None)


def write_mark(storage: Storage, dirkey: str, step: int, record_sha256: str, reason: str, where: str, by: str,
               key: bytes | None) -> QuarantineMark:
    """Write ``dirkey``'s mark (one atomic small object; replaces a garbage or stale one)."""
    mark = QuarantineMark(step=step, record_sha256=record_sha256, reason=reason, where=where, by=by).sign(key)
    storage.write_bytes(join_key(dirkey, QUARANTINE_NAME), mark.to_json().encode("utf-8"))
    storage.write_log.discard(join_key(dirkey, QUARANTINE_NAME))  # never a file a later commit names
    return mark
