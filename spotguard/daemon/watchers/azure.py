"""Azure IMDS Scheduled Events watcher.

Polls ``/metadata/scheduledevents`` once a second (Microsoft's recommendation)
and processes the document only when ``DocumentIncarnation`` changes. IMDS allows
about 5 requests/s per VM, so *every* request this watcher makes (events, VM name,
approvals, retries) goes through one pacer that spaces request starts at least
0.25 s apart: at most 5 starts in any closed 1 s window, whatever the poll
interval or error storm; a 429 also honours ``Retry-After``.

Scheduled events are broadcast to a whole availability/scale set, so only events
whose ``Resources`` name this VM are delivered; the name is ``--azure-vm-name``
or comes from ``/metadata/instance/compute`` and, until it is known, events stay
pending (not dropped, and logged) and the watcher reports itself blind. The
compute and events paths poll on their own schedules (``polling.py``): a failing
``compute`` never slows the events poll. ``NotBefore`` is read as RFC 1123 or ISO 8601. Notice ids derive from ``EventId``; an event that
disappears from the document yields ``Cancel``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Optional

from ...logs import get_logger
from ...notice import Cancel, Notice, WatchEvent, stable_id
from ...timefmt import parse_rfc1123, to_rfc3339, utcnow
from .base import Backoff
from .http import Fault, Resp, parse_json, reject_html, request, retry_after
from .polling import PollingWatcher

__all__ = ["AzureWatcher", "MIN_NOTICE", "MIN_REQUEST_SPACING", "VM_NAME_FIX", "parse_azure_date"]


log = get_logger("spotguard.watchers.azure")

PATH_EVENTS = "/metadata/scheduledevents"
PATH_COMPUTE = "/metadata/instance/compute"
COMPUTE_API_VERSION = "2021-02-01"
HEADERS = {"Metadata": "true"}

# IMDS throttles above ~5 requests/s: 0.25 s between starts keeps any closed 1 s
# window at ≤ 5 requests, with the timer's own jitter on the safe side.
MIN_REQUEST_SPACING = 0.25

_KINDS = {"Preempt": "preemption", "Terminate": "termination"}
# Minimum notice per event type (Azure Scheduled Events docs): the deadline when NotBefore is
# "" (event already started) or unreadable.
MIN_NOTICE: dict[str, timedelta] = {
    "Preempt": timedelta(seconds=30),
    "Terminate": timedelta(minutes=5),
    "Reboot": timedelta(minutes=15),
    "Freeze": timedelta(minutes=15),
    "Redeploy": timedelta(minutes=10),
}
_UNKNOWN_TYPE_NOTICE = timedelta(seconds=30)  # the shortest: safest for a type we do not know


VM_NAME_FIX = ("events name VMs and this VM's name is unknown until IMDS instance/compute answers: pass "
               "--azure-vm-name (SPOTGUARD_AZURE_VM_NAME), the name Scheduled Events list in Resources")

_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_azure_date(text: str) -> datetime:
    """``NotBefore``: RFC 1123 (``Mon, 19 Sep 2016 18:29:47 GMT``, documented) or ISO 8601
    (``2016-09-19T18:29:47Z``, also seen, with .NET's 7-digit fractions); no offset means UTC."""
    try:
        return parse_rfc1123(text)
    except ValueError:
        pass
    s = str(text).strip()
    if s[-1:] in ("Z", "z"):
        s = s[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(_FRACTION.sub(r"\1", s))
    except ValueError:
        raise ValueError(f"not an RFC 1123 or ISO 8601 date: {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc)


class _Pacer:
    """Spaces request starts ``spacing`` seconds apart, across all callers."""

    def __init__(self, spacing: float) -> None:
        self.spacing = spacing
        self._last = float("-inf")
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self._lock:
            delay = self._last + self.spacing - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._last = time.monotonic()


def _status_fault(resp: Resp, what: str) -> Fault:
    status = resp.status
    if status == 429:
        return Fault(
            "http_429",
            f"IMDS throttled {what}",
            "more than 5 requests/s from this VM; backing off",
            retry_after(resp.headers),
        )
    if status == 400:
        return Fault(
            "http_400",
            f"IMDS answered 400 on {what}: {resp.text[:200]!r}",
            "check the Metadata: true header and api-version",
        )
    if status == 403:
        return Fault("http_403", f"IMDS answered 403 on {what}", "bypass HTTP proxies for 169.254.169.254")
    return Fault(f"http_{status}", f"IMDS answered {status} on {what}", None, retry_after(resp.headers))


class AzureWatcher(PollingWatcher):
    """Scheduled Events poller; ``node`` is the VM name (known after the first compute answer)."""

    source = "azure"
    _log = log

    def __init__(
        self,
        base_url: str = "http://169.254.169.254",
        poll_interval: float = 1.0,
        *,
        api_version: str = "2020-07-01",
        request_timeout: float = 2.0,
        backoff_cap: float = 5.0,
        vm_name: Optional[str] = None,
        min_request_spacing: float = MIN_REQUEST_SPACING,
    ) -> None:
        super().__init__(base_url, poll_interval, lambda: Backoff(base=0.25, cap=backoff_cap))
        # Without the VM name no event can be matched to this VM: blind until it is known.
        self.health.require(PATH_EVENTS, *(() if vm_name else (PATH_COMPUTE,)))
        self.api_version = api_version
        self.request_timeout = request_timeout
        self.vm_name: Optional[str] = vm_name
        # Lower spacing only against an emulator with its rate limit off (tests).
        self._pacer = _Pacer(min_request_spacing)
        self._incarnation: Optional[int] = None  # last processed
        self._pending_logged: Optional[int] = None
        self._active: dict[str, str] = {}  # notice id -> EventId
        self._yielded: set[str] = set()

    @property
    def node(self) -> Optional[str]:
        return self.vm_name

    # ------------------------------------------------------------------ plumbing
    async def _request(self, method: str, path: str, api_version: str, body: Optional[dict[str, Any]] = None) -> Resp:
        """One paced request; every transport failure becomes a labelled ``Fault``."""
        await self._pacer.wait()
        return await request(
            self._get_session(),
            method,
            self.base_url + path,
            params={"api-version": api_version},
            headers=HEADERS,
            body=body,
            timeout=self.request_timeout,
            unreachable_fix="is this an Azure VM? check --metadata-url",
        )

    @staticmethod
    def _json(resp: Resp, what: str) -> Any:
        reject_html(resp, what, expected="IMDS JSON", fix="bypass HTTP proxies for 169.254.169.254")
        return parse_json(resp, what)

    # ------------------------------------------------------------------ polling
    def _started_details(self) -> dict[str, Any]:
        return {"api_version": self.api_version}

    def _paths(self) -> list[str]:
        return [PATH_COMPUTE, PATH_EVENTS]

    async def _poll(self, path: str) -> Optional[list[WatchEvent]]:
        if path == PATH_COMPUTE:
            if self.vm_name is None:
                await self._fetch_name()
            self.health.release(PATH_COMPUTE)
            return None  # known (or given): never asked again
        resp = await self._request("GET", PATH_EVENTS, self.api_version)
        if resp.status != 200:
            raise _status_fault(resp, PATH_EVENTS)
        doc = self._json(resp, PATH_EVENTS)
        incarnation, events = self._validate(doc, resp.text)
        return self._process(incarnation, events)

    async def _fetch_name(self) -> None:
        try:
            resp = await self._request("GET", PATH_COMPUTE, COMPUTE_API_VERSION)
        except Fault as fault:
            raise Fault(fault.reason, fault.message, fault.fix or VM_NAME_FIX) from None
        if resp.status != 200:
            fault = _status_fault(resp, PATH_COMPUTE)
            raise Fault(fault.reason, fault.message, fault.fix or VM_NAME_FIX, fault.retry_after)
        doc = self._json(resp, PATH_COMPUTE)
        name = doc.get("name") if isinstance(doc, dict) else None
        if not isinstance(name, str) or not name:
            raise Fault("bad_json", f"{PATH_COMPUTE}: no VM name in {resp.text[:200]!r}", VM_NAME_FIX)
        self.vm_name = name
        log.info("azure_identity", node=name)

    @staticmethod
    def _validate(doc: Any, raw: str) -> tuple[int, list[dict[str, Any]]]:
        if not isinstance(doc, dict):
            raise Fault("bad_json", f"{PATH_EVENTS}: expected an object, got {raw[:200]!r}")
        incarnation = doc.get("DocumentIncarnation")
        events = doc.get("Events")
        if isinstance(incarnation, bool) or not isinstance(incarnation, int) or not isinstance(events, list):
            raise Fault("bad_json", f"{PATH_EVENTS}: missing DocumentIncarnation/Events in {raw[:200]!r}")
        for event in events:
            if (
                not isinstance(event, dict)
                or not isinstance(event.get("EventId"), str)
                or not isinstance(event.get("EventType"), str)
            ):
                raise Fault("bad_json", f"{PATH_EVENTS}: malformed event {event!r}"[:300])
        return incarnation, events

    def _process(self, incarnation: int, events: list[dict[str, Any]]) -> list[WatchEvent]:
        if incarnation == self._incarnation:
            return []
        if self.vm_name is None:
            if events and self._pending_logged != incarnation:
                self._pending_logged = incarnation
                log.warning(
                    "azure_events_pending",
                    error="VM name unknown yet: cannot tell which events concern this VM; keeping them pending",
                    pending=len(events),
                    fix=VM_NAME_FIX,
                    event_ids=[e["EventId"] for e in events],
                    incarnation=incarnation,
                )
            if events:
                return []  # not marked processed: re-examined once the name is known
        now = utcnow()
        me = (self.vm_name or "").lower()
        out: list[WatchEvent] = []
        present: set[str] = set()
        for event in events:
            resources = event.get("Resources")
            names = {r.lower() for r in resources if isinstance(r, str)} if isinstance(resources, list) else set()
            notice_id = stable_id("azure", event["EventId"])
            if me not in names:
                log.debug("azure_event_other_vm", event_id=event["EventId"], resources=resources, vm=self.vm_name)
                continue
            present.add(notice_id)
            if notice_id in self._active:
                continue
            notice = Notice(
                id=notice_id,
                source="azure",
                kind=_KINDS.get(event["EventType"], "maintenance"),
                deadline=self._deadline(event, now),
                received_at=now,
                detail=json.dumps(event),  # the provider's fields, in its order
                key=event["EventId"],
            )
            self._active[notice_id] = event["EventId"]
            if notice_id in self._yielded:
                continue
            self._yielded.add(notice_id)
            log.info(
                "notice_seen",
                notice_id=notice_id,
                source="azure",
                kind=notice.kind,
                deadline=to_rfc3339(notice.deadline),
                event_id=event["EventId"],
                event_type=event["EventType"],
                status=event.get("EventStatus"),
            )
            out.append(notice)
        for notice_id in [n for n in self._active if n not in present]:
            event_id = self._active.pop(notice_id)
            self._yielded.discard(notice_id)
            log.info("notice_cancelled", notice_id=notice_id, source="azure", event_id=event_id)
            out.append(Cancel(id=notice_id, source="azure", detail=f"event {event_id} no longer scheduled"))
        self._incarnation = incarnation
        return out

    def _deadline(self, event: Mapping[str, Any], now: datetime) -> datetime:
        default = MIN_NOTICE.get(event["EventType"], _UNKNOWN_TYPE_NOTICE)
        not_before = event.get("NotBefore")
        if not not_before:  # "" once the event has started
            return now + default
        try:
            return parse_azure_date(not_before)
        except ValueError:
            self._error(
                Fault("bad_date", f"event {event['EventId']}: unreadable NotBefore {not_before!r}"),
                notice_id=stable_id("azure", event["EventId"]),
                assumed=f"now+{default.total_seconds():g}s",
            )
            return now + default

    # ------------------------------------------------------------------ approval
    async def approve(self, notice: Notice) -> bool:
        """``StartRequests`` for the notice's event: starts it for *every* VM it lists, so
        the daemon calls this only when configured and after every checkpoint is done.
        Failures are logged and counted, never raised; returns whether IMDS took it."""
        event_id = self._active.get(notice.id)
        if event_id is None:
            log.warning(
                "azure_approve_unknown", notice_id=notice.id, error="no active scheduled event with this notice id"
            )
            return False
        backoff = Backoff(base=0.25, cap=2.0)
        body = {"StartRequests": [{"EventId": event_id}]}
        for attempt in range(1, 4):
            try:
                resp = await self._request("POST", PATH_EVENTS, self.api_version, body)
                if resp.status == 200:
                    log.info("azure_event_approved", notice_id=notice.id, event_id=event_id)
                    return True
                fault = _status_fault(resp, f"POST {PATH_EVENTS}")
            except Fault as exc:
                fault = exc
            self.health.error(fault.reason, fault.message)
            log.warning(
                "azure_approve_error",
                notice_id=notice.id,
                event_id=event_id,
                attempt=attempt,
                reason=fault.reason,
                error=fault.message,
            )
            if attempt < 3:
                await self._sleep(max(backoff.next_delay(), fault.retry_after))
        log.error("azure_approve_failed", notice_id=notice.id, event_id=event_id, error="StartRequests failed 3 times")
        return False
