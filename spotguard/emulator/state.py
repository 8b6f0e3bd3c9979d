"""In-memory state of the metadata emulator: notices, tokens, faults, counters.

Everything the three cloud front-ends render is derived from one list of
``NoticeRecord``s, so the control API, the cloud views and ``/_emulator/state``
can never disagree. All methods are synchronous and must run on the event loop
thread; waiters (GCP hanging GETs, hung requests) are woken through
``asyncio.Event``s, never by polling.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import time
import uuid
from datetime import timedelta
from typing import Any, Deque, Optional

from aiohttp import web

from ..timefmt import to_rfc3339, utcnow
from .records import (  # noqa: F401 - re-exported: the front-ends and tests import them from here
    AWS_CODE_DESCRIPTIONS,
    AWS_EVENT_CODES,
    AWS_SPOT_ACTIONS,
    AZURE_EVENT_TYPES,
    AZURE_MIN_NOTICE,
    CLOUDS,
    DEFAULT_IN_SECONDS,
    FAULT_MODES,
    KINDS,
    ControlError,
    EmulatorConfig,
    Fault,
    NoticeRecord,
    cloud_of_path,
)

__all__ = [
    "EmulatorConfig",
    "EmulatorState",
    "Fault",
    "NoticeRecord",
    "ControlError",
    "STATE_KEY",
    "CLOUDS",
    "FAULT_MODES",
    "cloud_of_path",
]

class EmulatorState:
    """All mutable emulator state; one instance per server."""

    def __init__(self, config: Optional[EmulatorConfig] = None) -> None:
        self.base_config = dataclasses.replace(config) if config else EmulatorConfig()
        self.config = dataclasses.replace(self.base_config)
        self.notices: list[NoticeRecord] = []
        self.faults: list[Fault] = []
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.requests: collections.Counter[str] = collections.Counter()
        self.request_log: Deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.azure_incarnation = 0
        self.azure_approved: list[str] = []
        self.azure_approved_unknown: list[str] = []
        self.azure_throttled = 0
        self._azure_window: Deque[float] = collections.deque()
        self._ids = itertools.count(1)
        self._gcp_changed = asyncio.Event()
        self._request_seen = asyncio.Event()
        self.closing = asyncio.Event()

    # ----- notices -------------------------------------------------------------
    def add_notice(
        self,
        cloud: str,
        kind: str,
        in_seconds: Optional[float] = None,
        *,
        action: Optional[str] = None,
        code: Optional[str] = None,
        description: Optional[str] = None,
        event_type: Optional[str] = None,
        resources: Optional[list[str]] = None,
        event_source: Optional[str] = None,
        duration: Optional[int] = None,
    ) -> NoticeRecord:
        """Schedule a notice the way the provider would publish it (see docs/emulator.md)."""
        if cloud not in CLOUDS:
            raise ControlError(f"cloud must be one of {', '.join(CLOUDS)}, got {cloud!r}")
        if kind not in KINDS:
            raise ControlError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if in_seconds is not None and (isinstance(in_seconds, bool) or not isinstance(in_seconds, (int, float))):
            raise ControlError("in_seconds must be a number")
        now = utcnow()
        rec = NoticeRecord(id="", cloud=cloud, kind=kind, created=now, deadline=now)
        if cloud == "aws":
            self._fill_aws(rec, kind, action, code, description)
        elif cloud == "gcp":
            if kind == "rebalance":
                raise ControlError("gcp has no rebalance notice")
            rec.id = f"gcp-{next(self._ids)}"
        else:
            self._fill_azure(rec, kind, event_type, resources, event_source, duration, description)
        if in_seconds is None:
            in_seconds = DEFAULT_IN_SECONDS.get((cloud, kind), AZURE_MIN_NOTICE.get(rec.event_type, 60.0))
        rec.deadline = now + timedelta(seconds=float(in_seconds))
        if cloud == "aws" and kind == "preemption":
            for old in self._active("aws", "preemption"):
                old.status = "canceled"  # one spot notice at a time, the newest wins
            lead = float(self.config.aws_rebalance_lead)
            if lead > 0:
                # The recommendation now, the interruption notice ``lead`` seconds later.
                self.add_notice("aws", "rebalance")
                rec.visible_from = now + timedelta(seconds=lead)
                rec.deadline = rec.deadline + timedelta(seconds=lead)
        if cloud == "aws" and kind == "rebalance":
            for old in self._active("aws", "rebalance"):
                old.status = "canceled"
        self.notices.append(rec)
        if cloud == "gcp":
            self._gcp_notify()
        elif cloud == "azure":
            self.azure_incarnation += 1
        return rec

    def _fill_aws(
        self, rec: NoticeRecord, kind: str, action: Optional[str], code: Optional[str], description: Optional[str]
    ) -> None:
        if kind == "preemption":
            rec.action = action or "terminate"
            if rec.action not in AWS_SPOT_ACTIONS:
                raise ControlError(f"action must be one of {', '.join(AWS_SPOT_ACTIONS)}")
            rec.id = f"aws-spot-{next(self._ids)}"
        elif kind == "rebalance":
            rec.id = f"aws-rebalance-{next(self._ids)}"
        elif kind == "maintenance":
            rec.code = code or "system-maintenance"
            if rec.code not in AWS_EVENT_CODES:
                raise ControlError(f"code must be one of {', '.join(AWS_EVENT_CODES)}")
            rec.description = description or AWS_CODE_DESCRIPTIONS[rec.code]
            rec.id = "instance-event-" + secrets.token_hex(9)[:17]
        else:
            rec.id = f"aws-asg-{next(self._ids)}"

    def _fill_azure(
        self,
        rec: NoticeRecord,
        kind: str,
        event_type: Optional[str],
        resources: Optional[list[str]],
        event_source: Optional[str],
        duration: Optional[int],
        description: Optional[str],
    ) -> None:
        default = {"preemption": "Preempt", "termination": "Terminate", "maintenance": "Freeze"}
        if event_type is None:
            if kind not in default:
                raise ControlError("azure has no rebalance notice (give event_type to force one)")
            event_type = default[kind]
        if event_type not in AZURE_EVENT_TYPES:
            raise ControlError(f"event_type must be one of {', '.join(AZURE_EVENT_TYPES)}")
        if resources is not None and (
            not isinstance(resources, list) or not all(isinstance(r, str) and r for r in resources)
        ):
            raise ControlError("resources must be a list of VM names")
        rec.event_type = event_type
        rec.resources = list(resources) if resources is not None else [self.config.azure_vm_name]
        rec.event_source = event_source or ("User" if event_type == "Redeploy" else "Platform")
        rec.duration = duration if duration is not None else (9 if event_type == "Freeze" else -1)
        rec.description = description or {
            "Preempt": "Virtual machine is being preempted.",
            "Terminate": "Virtual machine is being deleted.",
            "Freeze": "Host server is undergoing maintenance.",
            "Reboot": "Virtual machine is going to be restarted as requested by authorized user.",
            "Redeploy": "Virtual machine is being moved to another node.",
        }[event_type]
        rec.id = str(uuid.uuid4()).upper()

    def cancel(self, cloud: Optional[str] = None, notice_id: Optional[str] = None, state: str = "canceled") -> list[str]:
        """Withdraw notices; AWS scheduled events stay listed as canceled/completed, others vanish."""
        if cloud is not None and cloud not in CLOUDS:
            raise ControlError(f"cloud must be one of {', '.join(CLOUDS)}, got {cloud!r}")
        if cloud is None and notice_id is None:
            raise ControlError("cancel needs a cloud or an id")
        if state not in ("canceled", "completed"):
            raise ControlError("state must be canceled or completed")
        hit: list[NoticeRecord] = [
            r
            for r in self.notices
            if r.status in ("active", "started")
            and (cloud is None or r.cloud == cloud)
            and (notice_id is None or r.id == notice_id)
        ]
        if notice_id is not None and not hit:
            raise ControlError(f"no active notice with id {notice_id!r}")
        for rec in hit:
            rec.status = state if (rec.cloud == "aws" and rec.kind == "maintenance") else "canceled"
        if any(r.cloud == "gcp" for r in hit):
            self._gcp_notify()
        if any(r.cloud == "azure" for r in hit):
            self.azure_incarnation += 1
        return [r.id for r in hit]

    def _active(self, cloud: str, kind: Optional[str] = None) -> list[NoticeRecord]:
        return [r for r in self.notices if r.cloud == cloud and r.status == "active" and (kind is None or r.kind == kind)]

    # ----- AWS views -------------------------------------------------------------
    def issue_token(self, ttl: int) -> str:
        """A fresh IMDSv2 token; ``aws_token_max_ttl`` silently shortens its real life."""
        life = float(ttl)
        if self.config.aws_token_max_ttl is not None:
            life = min(life, float(self.config.aws_token_max_ttl))
        token = secrets.token_urlsafe(42)
        self.tokens[token] = time.monotonic() + life
        return token

    def token_valid(self, token: Optional[str]) -> bool:
        if not token:
            return False
        expiry = self.tokens.get(token)
        if expiry is None:
            return False
        if time.monotonic() >= expiry:
            del self.tokens[token]
            return False
        return True

    def aws_spot(self) -> Optional[NoticeRecord]:
        now = utcnow()
        active = [r for r in self._active("aws", "preemption") if r.visible_from is None or r.visible_from <= now]
        return active[-1] if active else None

    def aws_spot_time(self, rec: NoticeRecord) -> str:
        """The spot ``time``; with ``aws_recompute_time`` it is recomputed on every request as
        amazon-ec2-metadata-mock does: now + the notice's length, in whole seconds (so it moves on)."""
        if not self.config.aws_recompute_time:
            return rec.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
        length = rec.deadline - (rec.visible_from or rec.created)
        return (utcnow() + length).strftime("%Y-%m-%dT%H:%M:%SZ")

    def aws_rebalance(self) -> Optional[NoticeRecord]:
        active = self._active("aws", "rebalance")
        return active[-1] if active else None

    def aws_scheduled(self) -> list[NoticeRecord]:
        return [r for r in self.notices if r.cloud == "aws" and r.kind == "maintenance"]

    def aws_lifecycle(self) -> Optional[str]:
        if self._active("aws", "termination"):
            return "Terminated"
        return "InService" if self.config.asg else None

    # ----- GCP views -------------------------------------------------------------
    def gcp_values(self) -> dict[str, str]:
        preempted = bool(self._active("gcp", "preemption"))
        event = "NONE"
        for rec in self._active("gcp"):
            if rec.kind == "termination":
                event = "TERMINATE_ON_HOST_MAINTENANCE"
            elif rec.kind == "maintenance":
                event = "MIGRATE_ON_HOST_MAINTENANCE"
        return {"preempted": "TRUE" if preempted else "FALSE", "maintenance-event": event}

    def gcp_upcoming_maintenance(self) -> Optional[dict[str, Any]]:
        """``instance/upcoming-maintenance`` while a host maintenance is announced (None = 404):
        the window opens at the notice's deadline (GPU VMs are told about an hour ahead)."""
        recs = [r for r in self._active("gcp") if r.kind in ("termination", "maintenance")]
        if not recs:
            return None
        rec = min(recs, key=lambda r: r.deadline)
        start = rec.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "maintenanceType": "SCHEDULED",
            "canReschedule": False,
            "windowStartTime": start,
            "windowEndTime": (rec.deadline + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "latestWindowStartTime": start,
            "maintenanceStatus": "PENDING",
        }

    def _gcp_notify(self) -> None:
        """Wake every hanging GET; each re-renders and decides whether its value changed."""
        event, self._gcp_changed = self._gcp_changed, asyncio.Event()
        event.set()

    def gcp_change_event(self) -> asyncio.Event:
        """The event that fires on the next GCP change (take it *before* rendering)."""
        return self._gcp_changed

    # ----- Azure views -----------------------------------------------------------
    def azure_allow(self) -> bool:
        """Sliding 1 s window over every Azure request (throttled ones count too)."""
        limit = self.config.azure_rate_limit
        now = time.monotonic()
        window = self._azure_window
        window.append(now)
        while window and window[0] <= now - 1.0:
            window.popleft()
        if limit <= 0 or len(window) <= limit:
            return True
        self.azure_throttled += 1
        return False

    def azure_events(self) -> list[NoticeRecord]:
        """Events in the document; a scheduled event whose NotBefore passed starts by itself."""
        now = utcnow()
        changed = False
        for rec in self.notices:
            if rec.cloud == "azure" and rec.status == "active" and rec.deadline <= now:
                rec.status = "started"
                changed = True
        if changed:
            self.azure_incarnation += 1
        return [r for r in self.notices if r.cloud == "azure" and r.status in ("active", "started")]

    def azure_approve(self, event_ids: list[str]) -> list[str]:
        """StartRequests: the event starts (for every VM it names) and NotBefore empties."""
        started: list[str] = []
        by_id = {r.id.lower(): r for r in self.notices if r.cloud == "azure" and r.status in ("active", "started")}
        for event_id in event_ids:
            rec = by_id.get(event_id.lower())
            if rec is None:
                self.azure_approved_unknown.append(event_id)
                continue
            self.azure_approved.append(rec.id)
            if rec.status == "active":
                rec.status = "started"
                started.append(rec.id)
        if started:
            self.azure_incarnation += 1
        return started

    # ----- faults ----------------------------------------------------------------
    def add_fault(
        self,
        mode: str,
        cloud: str = "*",
        path: str = "",
        status: int = 503,
        delay: float = 2.0,
        count: Optional[int] = None,
        retry_after: Optional[int] = None,
    ) -> Fault:
        """Inject a failure for matching requests (checked before any cloud logic)."""
        if mode not in FAULT_MODES:
            raise ControlError(f"mode must be one of {', '.join(FAULT_MODES)}, got {mode!r}")
        if cloud not in (*CLOUDS, "*"):
            raise ControlError(f"cloud must be aws, gcp, azure or *, got {cloud!r}")
        if not isinstance(path, str) or (path and not path.startswith("/")):
            raise ControlError("path must be a path prefix starting with /")
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ControlError("status must be an HTTP status code")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ControlError("delay must be a number of seconds >= 0")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ControlError("count must be a positive integer or null")
        if retry_after is not None and (isinstance(retry_after, bool) or not isinstance(retry_after, int)):
            raise ControlError("retry_after must be an integer")
        fault = Fault(
            id=f"fault-{next(self._ids)}",
            cloud=cloud,
            mode=mode,
            path=path,
            status=status,
            delay=float(delay),
            retry_after=retry_after,
            remaining=count,
        )
        self.faults.append(fault)
        return fault

    def take_fault(self, cloud: Optional[str], path: str) -> Optional[Fault]:
        """The first matching fault, its count consumed; exhausted faults are dropped."""
        for fault in self.faults:
            if fault.matches(cloud, path):
                fault.hits += 1
                if fault.remaining is not None:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self.faults.remove(fault)
                return fault
        return None

    def clear_faults(self, fault_id: Optional[str] = None) -> int:
        before = len(self.faults)
        self.faults = [f for f in self.faults if fault_id is not None and f.id != fault_id]
        return before - len(self.faults)

    # ----- bookkeeping -----------------------------------------------------------
    def count_request(self, method: str, path: str, query: str) -> dict[str, Any]:
        """Count ``METHOD path`` (tests assert no busy loops with it); returns the log entry."""
        self.requests[f"{method} {path}"] += 1
        entry: dict[str, Any] = {"time": to_rfc3339(utcnow()), "method": method, "path": path, "query": query, "status": None}
        self.request_log.append(entry)
        seen, self._request_seen = self._request_seen, asyncio.Event()
        seen.set()
        return entry

    async def wait_requests(self, method: str, path: str, n: int = 1, timeout: float = 5.0) -> int:
        """Wait until ``METHOD path`` was requested ``n`` times (tests: "the watcher is now waiting")."""

        async def _wait() -> int:
            while self.request_count(method, path) < n:
                await self._request_seen.wait()
            return self.request_count(method, path)

        return await asyncio.wait_for(_wait(), timeout)

    def request_count(self, method: str, path: str) -> int:
        return self.requests.get(f"{method} {path}", 0)

    def reset(self) -> None:
        """Back to start-up state; Azure's incarnation moves on (the document changed)."""
        had_gcp = any(r.cloud == "gcp" and r.status == "active" for r in self.notices)
        self.notices.clear()
        self.faults.clear()
        self.tokens.clear()
        self.requests.clear()
        self.request_log.clear()
        self._azure_window.clear()
        self.azure_approved.clear()
        self.azure_approved_unknown.clear()
        self.azure_throttled = 0
        self.azure_incarnation += 1
        self.config = dataclasses.replace(self.base_config)
        if had_gcp:
            self._gcp_notify()

    def close(self) -> None:
        """Server shutdown: release every hanging request."""
        self.closing.set()
        self._gcp_notify()

    def snapshot(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "notices": [r.to_dict() for r in self.notices],
            "faults": [f.to_dict() for f in self.faults],
            "aws": {"tokens": len(self.tokens)},
            "gcp": self.gcp_values(),
            "azure": {
                "incarnation": self.azure_incarnation,
                "approved": list(self.azure_approved),
                "approved_unknown": list(self.azure_approved_unknown),
                "throttled": self.azure_throttled,
            },
            "requests": dict(self.requests),
            "request_log_tail": list(self.request_log),
        }


STATE_KEY: web.AppKey[EmulatorState] = web.AppKey("spotguard_emulator_state", EmulatorState)
