"""The commit record (``COMMIT.json``): what a committed checkpoint is, as data.

Format 2 lists every file with its size and CRC32C block checksums (``integrity.py``) and, when the job sets
``$SPOTGUARD_COMMIT_KEY``, an HMAC-SHA256 that a writer without the key cannot forge. Parsing refuses
anything malformed. Apart from ``commit.py`` (the protocol that writes, scans and retires folders) because
the record is read by itself too: the CLI's listing, ``verify.py`` and every resume path.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..timefmt import parse_rfc3339, to_rfc3339, utcnow
from .base import StorageError, check_key
from .integrity import ALGORITHM, BLOCK_SIZE, FileDigest
from .quarantine import QUARANTINE_NAME

__all__ = ["FORMAT", "KEY_ENV", "COMMIT_NAME", "REASONS", "CommitRecord", "job_key"]

FORMAT = 2
KEY_ENV = "SPOTGUARD_COMMIT_KEY"  # the job secret that signs and checks commit records (optional)
COMMIT_NAME = "COMMIT.json"
REASONS: tuple[str, ...] = ("emergency", "periodic", "final", "manual")


def _int(data: Mapping[str, Any], name: str, minimum: int = 0) -> int:
    v = data[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"commit record field {name!r} must be an integer, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"commit record field {name!r} must be >= {minimum}, got {v}")
    return v


def _str(data: Mapping[str, Any], name: str) -> str:
    v = data[name]
    if not isinstance(v, str):
        raise ValueError(f"commit record field {name!r} must be a string, got {type(v).__name__}")
    return v


def _check_file_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"commit record file name must be a non-empty string, got {name!r}")
    try:
        check_key(name)
    except StorageError as exc:
        raise ValueError(f"commit record file name {name!r} is not a safe relative path: {exc}") from None
    if name == COMMIT_NAME:
        raise ValueError(f"commit record lists itself ({COMMIT_NAME}) as a file")
    if name == QUARANTINE_NAME:
        raise ValueError(f"commit record lists {QUARANTINE_NAME} (the quarantine mark) as a file")
    return name


@dataclass
class CommitRecord:
    """The manifest of one checkpoint; its presence (valid) is what makes the checkpoint count."""

    step: int
    world_size: int = 1
    reason: str = "manual"
    notice_id: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    created_at: str = field(default_factory=lambda: to_rfc3339(utcnow()))
    spotguard_version: str = field(default_factory=lambda: _version())
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT
    checksums: dict[str, FileDigest] = field(default_factory=dict)
    signature: str | None = None

    def validate(self) -> "CommitRecord":
        """Raise ValueError naming the first problem; returns self."""
        self.from_dict(self.to_dict())
        return self

    def to_dict(self) -> dict[str, Any]:
        d = self._body()
        if self.signature is not None:
            d["hmac"] = self.signature
        return d

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": self.format if self.checksums else 1,  # no checksums: what format 1 records say
            "step": self.step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "reason": self.reason,
            "notice_id": self.notice_id,
            "files": dict(sorted(self.files.items())),
            "bytes": self.bytes,
            "seconds": self.seconds,
            "spotguard_version": self.spotguard_version,
            "extra": self.extra,
        }
        if self.format >= 2 and self.checksums:
            body["checksum"] = {"algorithm": ALGORITHM, "block_size": BLOCK_SIZE}
            body["checksums"] = {n: d.blocks for n, d in sorted(self.checksums.items())}
        return body

    def sign(self, key: bytes | None) -> "CommitRecord":
        """Set ``signature`` to the HMAC-SHA256 of the record's canonical JSON (None key: unsigned)."""
        self.signature = None if not key else _mac(key, self._body())
        return self

    def signature_problem(self, key: bytes | None) -> str | None:
        """Why this record's signature does not check out under ``key`` (None: it does, or no key is set)."""
        if not key:
            return None
        if self.signature is None:
            return f"commit record is not signed but ${KEY_ENV} is set"
        if not _hmac.compare_digest(self.signature, _mac(key, self._body())):
            return f"commit record signature does not match ${KEY_ENV} (forged or altered record)"
        return None

    def to_json(self) -> str:
        """Stable, human-readable JSON; validates first so a bad record is never written."""
        self.validate()
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> "CommitRecord":
        """Parse and strictly validate; any problem is a ValueError naming it."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"commit record is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not isinstance(text, str):
            raise ValueError(f"commit record must be text, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("commit record is empty")
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise ValueError("commit record is nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError and our NaN/Infinity rejection
            raise ValueError(f"commit record is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "CommitRecord":
        if not isinstance(data, dict):
            raise ValueError(f"commit record must be a JSON object, got {type(data).__name__}")
        required = ("format", "step", "created_at", "world_size", "reason", "files", "bytes")
        for name in required:
            if name not in data:
                raise ValueError(f"commit record is missing field {name!r}")
        fmt = _int(data, "format", 1)
        if fmt > FORMAT:
            raise ValueError(f"commit record format {fmt} is newer than this spotguard understands ({FORMAT})")
        step = _int(data, "step", 0)
        created_at = _str(data, "created_at")
        try:
            parse_rfc3339(created_at)
        except (ValueError, TypeError, OverflowError):
            raise ValueError(f"commit record created_at {created_at!r} is not an RFC 3339 time") from None
        world_size = _int(data, "world_size", 1)
        reason = _str(data, "reason")
        if reason not in REASONS:
            raise ValueError(f"commit record reason {reason!r} is not one of {', '.join(REASONS)}")
        notice_id = data.get("notice_id")
        if notice_id is not None and not isinstance(notice_id, str):
            raise ValueError(f"commit record notice_id must be a string or null, got {type(notice_id).__name__}")
        files_raw = data["files"]
        if not isinstance(files_raw, dict):
            raise ValueError(f"commit record 'files' must be an object, got {type(files_raw).__name__}")
        files: dict[str, int] = {}
        for name, size in files_raw.items():
            _check_file_name(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"commit record size of file {name!r} must be a non-negative integer, got {size!r}")
            files[name] = size
        total = _int(data, "bytes", 0)
        if files and total != sum(files.values()):
            raise ValueError(f"commit record bytes={total} does not equal the sum of file sizes {sum(files.values())}")
        seconds = data.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"commit record seconds must be a finite non-negative number, got {seconds!r}")
        version = data.get("spotguard_version", "")
        if not isinstance(version, str):
            raise ValueError("commit record spotguard_version must be a string")
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError(f"commit record 'extra' must be an object, got {type(extra).__name__}")
        checksums = _checksums(data, files) if fmt >= 2 else {}
        signature = data.get("hmac")
        if signature is not None and not isinstance(signature, str):
            raise ValueError("commit record hmac must be a string")
        return cls(
            format=fmt, step=step, created_at=created_at, world_size=world_size, reason=reason,
            notice_id=notice_id, files=files, bytes=total, seconds=float(seconds),
            spotguard_version=version, extra=extra, checksums=checksums, signature=signature,
        )


def _checksums(data: Mapping[str, Any], files: Mapping[str, int]) -> dict[str, FileDigest]:
    meta = data.get("checksum")
    if meta != {"algorithm": ALGORITHM, "block_size": BLOCK_SIZE}:
        raise ValueError(f"commit record checksum {meta!r} is not {ALGORITHM} in {BLOCK_SIZE}-byte blocks")
    raw = data.get("checksums")
    if not isinstance(raw, dict) or set(raw) != set(files):
        raise ValueError("commit record 'checksums' must name exactly the files it lists")
    out: dict[str, FileDigest] = {}
    for name, blocks in raw.items():
        if not isinstance(blocks, str):
            raise ValueError(f"commit record checksum of {name!r} must be a string")
        try:
            out[name] = FileDigest(files[name], blocks).check()
        except ValueError as exc:
            raise ValueError(f"commit record checksum of {name!r}: {exc}") from None
    return out


def _mac(key: bytes, body: Mapping[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return _hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def job_key() -> bytes | None:
    """The job secret from ``$SPOTGUARD_COMMIT_KEY`` (None when unset)."""
    value = os.environ.get(KEY_ENV, "")
    return value.encode("utf-8") if value else None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _version() -> str:
    from ..version import __version__

    return __version__
