"""AWS EC2 instance metadata (IMDS) watcher.

Polls the spot interruption notice, the rebalance recommendation, scheduled
events and the Auto Scaling target lifecycle state, each path on its own
schedule and backoff (``polling.py``), so one failing path never delays another. Speaks IMDSv2 (session token, refreshed well
before it expires, re-fetched on 401) and detects the container hop-limit trap:
a token PUT that times out gets one clear warning naming the fix, then IMDSv1
is used only if the instance answers tokenless GETs.

Notice ids (see ``stable_id``) are stable across polls of one notice and unique
per occurrence (the daemon never re-sends an id it has seen):

* spot ``instance-action``: ``action`` + the ``time`` of the first sighting + when
  that was. amazon-ec2-metadata-mock recomputes ``time`` (now + 2 min, whole
  seconds) on every request, so the first sighting (its id and deadline) is
  remembered for as long as the notice stays present, and the content key a
  restarted daemon matches its persisted notices by is the action alone.
* rebalance: the first ``noticeTime`` + when it was first seen, remembered the same way
  (key ``rebalance``).
* scheduled events: the ``EventId`` (``EventId`` + ``termination`` once the
  event escalates, see ``TERMINATION_THRESHOLD``).
* ASG ``Terminated``: the time it was first seen, remembered while it lasts.

Spot, rebalance and ASG notices vanishing yields no ``Cancel`` (AWS never
withdraws them; a VM that outlives one simply gets a new id next time); only
scheduled events that turn completed/canceled, or leave the list, are cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Optional

from ...logs import get_logger
from ...notice import Cancel, Notice, WatchEvent, stable_id
from ...timefmt import parse_rfc1123, parse_rfc3339, to_rfc3339, utcnow
from .base import Backoff
from .http import Fault, Resp, parse_json, reject_html, request, retry_after
from .polling import PollingWatcher

__all__ = ["AwsWatcher", "TERMINATION_THRESHOLD", "HOP_LIMIT_FIX"]


log = get_logger("spotguard.watchers.aws")

PATH_TOKEN = "/latest/api/token"
PATH_SPOT = "/latest/meta-data/spot/instance-action"
PATH_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
PATH_SCHEDULED = "/latest/meta-data/events/maintenance/scheduled"
PATH_ASG = "/latest/meta-data/autoscaling/target-lifecycle-state"
PATH_IDENTITY = "/latest/dynamic/instance-identity/document"

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"

HOP_LIMIT_FIX = ("set the instance's metadata HttpPutResponseHopLimit to 2 (aws ec2 modify-instance-metadata-options "
                 "--http-put-response-hop-limit 2; AL2023 node groups and Karpenter default to 1) or use host "
                 "networking (the hostNetwork DaemonSet)")

# A scheduled stop/retirement/system-maintenance whose NotBefore is this close is
# treated as a termination (emergency checkpoint), not a softer maintenance notice.
TERMINATION_THRESHOLD = timedelta(minutes=5)
TERMINATING_CODES = frozenset({"instance-stop", "instance-retirement", "system-maintenance"})
# AWS gives spot interruptions two minutes; used when a notice's time is unreadable
# and for rebalance / ASG notices, which carry no deadline of their own.
SPOT_NOTICE = timedelta(seconds=120)

_LIFECYCLE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz:")
_IDENTITY_ATTEMPTS = 5
# A spot notice that answers 404 for this long (every poll in between) is withdrawn. AWS itself never
# withdraws one; what does is an emulator's or a fault-injection tool's cancel, which a rehearsal must see
# (without it the daemon kept the notice a minute past its deadline and every restart exited at once).
# Long enough that a metadata blip (a 404 or two) never withdraws a real notice.
SPOT_WITHDRAWN_AFTER = 5.0


@dataclass
class _Seen:
    """A notice that is present now: its key (what identifies it across polls) and id."""

    key: str
    id: str
    gone_since: Optional[float] = None  # monotonic time of the first 404 in a row (spot only)


def _status_fault(resp: Resp, path: str) -> Fault:
    status = resp.status
    wait = retry_after(resp.headers)
    if status == 401:
        return Fault(
            "http_401", f"IMDS rejected the session token twice on {path}", "check that nothing rewrites IMDS requests"
        )
    if status == 403:
        return Fault(
            "http_403",
            f"IMDS answered 403 on {path}",
            "IMDS is disabled or the request was proxied: enable the endpoint "
            "(aws ec2 modify-instance-metadata-options --http-endpoint enabled) and bypass proxies",
        )
    if status == 429:
        return Fault(
            "http_429",
            f"IMDS throttled {path}",
            "link-local traffic is limited to ~1024 packets/s; backing off",
            wait,
        )
    if status >= 500:
        return Fault(f"http_{status}", f"IMDS answered {status} on {path}", None, wait)
    return Fault(f"http_{status}", f"unexpected HTTP {status} on {path}")


def _check_type(resp: Resp, path: str) -> None:
    """IMDS answers text/plain (or JSON); an HTML page means a proxy or captive portal."""
    reject_html(resp, path, expected="IMDS data", fix="bypass HTTP proxies for 169.254.169.254")


def _json(resp: Resp, path: str) -> Any:
    _check_type(resp, path)
    return parse_json(resp, path)


class AwsWatcher(PollingWatcher):
    """IMDS poller; ``node`` is the instance id (from the identity document, best effort)."""

    source = "aws"
    _log = log

    def __init__(
        self,
        base_url: str = "http://169.254.169.254",
        poll_interval: float = 0.5,
        *,
        token_ttl: int = 21600,
        put_timeout: float = 1.0,
        request_timeout: float = 2.0,
        backoff_cap: float = 5.0,
    ) -> None:
        if not 1 <= token_ttl <= 21600:
            raise ValueError(f"token_ttl must be within 1..21600 seconds, got {token_ttl}")
        super().__init__(base_url, poll_interval, lambda: Backoff(base=min(0.2, poll_interval), cap=backoff_cap))
        self.health.require(PATH_SPOT, PATH_REBALANCE, PATH_SCHEDULED, PATH_ASG)
        self.token_ttl = token_ttl
        self.put_timeout = put_timeout
        self.request_timeout = request_timeout
        self.node: Optional[str] = None
        self.identity: dict[str, Any] = {}
        self.imdsv1 = False  # True once fallen back to tokenless requests
        self._token_backoff = Backoff(base=0.2, cap=backoff_cap)
        self._identity_backoff = Backoff(base=0.2, cap=backoff_cap)
        self._token_lock = asyncio.Lock()
        self._token_fault: Optional[Fault] = None
        self._token: Optional[str] = None
        self._token_expires = 0.0  # monotonic
        self._token_refresh_at = 0.0  # monotonic
        self._next_refresh_try = 0.0
        self._hop_warned = False
        self._identity_attempts = 0
        self._spot: Optional[_Seen] = None
        self._rebalance: Optional[_Seen] = None
        self._asg: Optional[_Seen] = None
        self._scheduled: dict[str, dict[str, str]] = {}  # EventId -> {kind: notice id}
        self._yielded: set[str] = set()

    # ------------------------------------------------------------------ plumbing
    async def _request(self, method: str, path: str, *, headers: dict[str, str], timeout: float) -> Resp:
        return await request(
            self._get_session(),
            method,
            self.base_url + path,
            headers=headers,
            timeout=timeout,
            unreachable_fix="is this an EC2 instance? check --metadata-url",
        )

    # ------------------------------------------------------------------ session
    async def _acquire_token(self) -> bool:
        """Make sure requests can be authenticated (token or IMDSv1); False if not now (then
        ``_token_fault`` says why). One PUT at a time, whichever path asks."""
        async with self._token_lock:
            return await self._acquire_token_locked()

    async def _acquire_token_locked(self) -> bool:
        if self.imdsv1:
            return True
        now = time.monotonic()
        have_valid = self._token is not None and now < self._token_expires
        if have_valid and (now < self._token_refresh_at or now < self._next_refresh_try):
            return True
        if not have_valid and now < self._next_refresh_try:
            return False
        try:
            resp = await self._request(
                "PUT", PATH_TOKEN, headers={TTL_HEADER: str(self.token_ttl)}, timeout=self.put_timeout
            )
        except Fault as fault:
            if fault.reason == "timeout":
                return await self._on_put_timeout(have_valid)
            self._token_fault = Fault(fault.reason, f"token PUT {PATH_TOKEN}: {fault.message}", fault.fix)
            self._next_refresh_try = time.monotonic() + self._token_backoff.next_delay()
            return have_valid
        token = resp.text.strip()
        if resp.status != 200 or not token:
            bad = (
                _status_fault(resp, PATH_TOKEN)
                if resp.status != 200
                else Fault("bad_token", "IMDS returned an empty token")
            )
            self._token_fault = Fault(bad.reason, f"token PUT {PATH_TOKEN}: {bad.message}", bad.fix,
                                      bad.retry_after)
            self._next_refresh_try = time.monotonic() + self._token_backoff.next_delay()
            return have_valid
        ttl = float(self.token_ttl)
        echoed = resp.headers.get(TTL_HEADER)
        if echoed:
            try:
                ttl = max(1.0, min(ttl, float(echoed)))
            except ValueError:
                pass
        got = time.monotonic()
        self._token = token
        self._token_expires = got + ttl
        # Refresh half-way for short tokens, five minutes ahead for long ones.
        self._token_refresh_at = got + ttl - min(ttl / 2.0, 300.0)
        self._next_refresh_try = 0.0
        self._token_fault = None
        self._token_backoff.reset()
        log.debug("aws_token_acquired", ttl=ttl)
        return True

    async def _on_put_timeout(self, have_valid: bool) -> bool:
        """Hop-limit case: the PUT reply never reaches a container behind one more hop."""
        message = f"IMDSv2 token PUT got no answer within {self.put_timeout:g}s"
        self._token_fault = Fault("token_put_timeout", message + " (the PUT response hop limit of 1, seen from a "
                                  "container without host networking?)", HOP_LIMIT_FIX)
        if not self._hop_warned:
            self._hop_warned = True
            log.warning(
                "aws_token_put_timeout",
                reason="token_put_timeout",
                error=message + " (usually the PUT response hop limit of 1, seen from a container)",
                fix=HOP_LIMIT_FIX,
            )
        else:
            log.debug("aws_token_put_timeout_again", error=message)
        self._next_refresh_try = time.monotonic() + self._token_backoff.next_delay()
        if have_valid:
            return True
        if await self._probe_imdsv1():
            self.imdsv1 = True
            log.warning(
                "aws_imdsv1_fallback",
                error="using IMDSv1 (tokenless) because the token PUT times out and the instance answers v1",
                fix=HOP_LIMIT_FIX,
            )
            return True
        return False

    async def _probe_imdsv1(self) -> bool:
        try:
            resp = await self._request("GET", PATH_SPOT, headers={}, timeout=self.request_timeout)
        except Fault as fault:
            log.debug("aws_imdsv1_probe_failed", reason=fault.reason, error=fault.message)
            return False
        log.debug("aws_imdsv1_probe", status=resp.status)
        return resp.status in (200, 404)

    def _auth_headers(self) -> dict[str, str]:
        if self.imdsv1 or self._token is None:
            return {}
        return {TOKEN_HEADER: self._token}

    async def _get(self, path: str) -> Resp:
        return await self._request("GET", path, headers=self._auth_headers(), timeout=self.request_timeout)

    # ------------------------------------------------------------------ polling
    def _paths(self) -> list[str]:
        return [PATH_SPOT, PATH_REBALANCE, PATH_SCHEDULED, PATH_ASG, PATH_IDENTITY]

    async def _authed_get(self, path: str) -> Resp:
        """A GET with the session token; one fresh token and one retry on 401."""
        if not await self._acquire_token():
            raise self._token_fault or Fault("no_token", "no IMDSv2 session token yet")
        used = self._token
        resp = await self._get(path)
        if resp.status != 401:
            return resp
        # Expired or revoked token (or IMDSv1 switched off): one fresh session, one retry.
        async with self._token_lock:
            if self.imdsv1:
                self.imdsv1 = False
                log.warning("aws_imdsv1_refused", error="IMDS now requires a token; back to IMDSv2")
            if self._token == used:  # not already replaced by another path's retry
                self._token = None
                self._token_expires = self._token_refresh_at = self._next_refresh_try = 0.0
                log.info("aws_token_rejected", path=path)
        if not await self._acquire_token():
            raise self._token_fault or Fault("no_token", "no IMDSv2 session token")
        return await self._get(path)

    async def _poll(self, path: str) -> Optional[list[WatchEvent]]:
        if path == PATH_IDENTITY:
            return await self._poll_identity()
        answer = await self._authed_get(path)
        now = utcnow()
        if path == PATH_SPOT:
            return self._handle_spot(answer, now)
        if path == PATH_REBALANCE:
            return self._handle_rebalance(answer, now)
        if path == PATH_SCHEDULED:
            return self._handle_scheduled(answer, now)
        return self._handle_asg(answer, now)

    async def _poll_identity(self) -> Optional[list[WatchEvent]]:
        """Best effort, a few attempts (paced like any path): the instance id for ``hello`` and logs."""
        if self.node is not None or self._identity_attempts >= _IDENTITY_ATTEMPTS:
            return None
        self._identity_attempts += 1
        try:
            self._handle_identity(await self._authed_get(PATH_IDENTITY))
        except Fault as fault:
            log.debug("aws_identity_unavailable", reason=fault.reason, error=fault.message)
            if self._identity_attempts >= _IDENTITY_ATTEMPTS:
                return None
            await self._sleep(self._identity_backoff.next_delay())
            return []
        return None if self.node is not None else []

    def _emit(self, notice: Notice) -> list[WatchEvent]:
        if notice.id in self._yielded:
            return []
        self._yielded.add(notice.id)
        log.info(
            "notice_seen",
            notice_id=notice.id,
            source="aws",
            kind=notice.kind,
            deadline=to_rfc3339(notice.deadline),
            detail=notice.detail,
        )
        return [notice]

    def _cancel(self, notice_id: str, detail: str) -> list[WatchEvent]:
        self._yielded.discard(notice_id)
        log.info("notice_cancelled", notice_id=notice_id, source="aws", detail=detail)
        return [Cancel(id=notice_id, source="aws", detail=detail)]

    def _deadline(self, text: Any, now: datetime, default: timedelta, what: str, notice_id: str) -> datetime:
        """Parse an RFC 3339 time; an unreadable one costs a health error, not the notice."""
        try:
            return parse_rfc3339(text)
        except (ValueError, TypeError):
            self._error(
                Fault("bad_date", f"{what}: unreadable time {text!r}"),
                notice_id=notice_id,
                assumed=f"now+{default.total_seconds():g}s",
            )
            return now + default

    def _handle_identity(self, resp: Resp) -> None:
        if resp.status != 200:
            raise _status_fault(resp, PATH_IDENTITY)
        doc = _json(resp, PATH_IDENTITY)
        if isinstance(doc, dict) and isinstance(doc.get("instanceId"), str):
            self.identity = doc
            self.node = doc["instanceId"]
            log.info("aws_identity", node=self.node, region=doc.get("region"), instance_type=doc.get("instanceType"))

    def _handle_spot(self, resp: Resp, now: datetime) -> list[WatchEvent]:
        if resp.status == 404:
            return self._spot_absent()
        if resp.status != 200:
            raise _status_fault(resp, PATH_SPOT)
        doc = _json(resp, PATH_SPOT)
        if not isinstance(doc, dict) or not isinstance(doc.get("action"), str):
            raise Fault("bad_json", f"{PATH_SPOT}: expected {{'action', 'time'}}, got {resp.text[:200]!r}")
        action = doc["action"]
        if self._spot is not None and self._spot.key == action and self._spot.gone_since is None:
            return []  # same notice; a recomputed `time` must not make it new (after a 404: a new occurrence)
        notice_id = stable_id("aws", "spot", action, doc.get("time"), now.isoformat())
        notice = Notice(
            id=notice_id,
            source="aws",
            kind="preemption",
            deadline=self._deadline(doc.get("time"), now, SPOT_NOTICE, PATH_SPOT, notice_id),
            received_at=now,
            detail=resp.text.strip(),
            # Not the time: amazon-ec2-metadata-mock recomputes it (now + 2 min, whole seconds) on every
            # request, so after a daemon restart the same notice shows another time. AWS never withdraws a
            # spot notice, and the persisted entry expires a minute after its deadline.
            key=f"spot|{action}",
        )
        self._spot = _Seen(key=action, id=notice.id)
        return self._emit(notice)

    def _spot_absent(self) -> list[WatchEvent]:
        """No spot notice now: withdraw the one seen once it has been absent for ``SPOT_WITHDRAWN_AFTER``."""
        seen = self._spot
        if seen is None:
            return []
        mono = time.monotonic()
        if seen.gone_since is None:
            seen.gone_since = mono
            return []
        if mono - seen.gone_since < SPOT_WITHDRAWN_AFTER:
            return []
        self._spot = None
        return self._cancel(seen.id, f"{PATH_SPOT} answered 404 for {mono - seen.gone_since:.1f} s: withdrawn "
                                     "(AWS does not withdraw spot notices; an emulator or fault-injection cancel does)")

    def _handle_rebalance(self, resp: Resp, now: datetime) -> list[WatchEvent]:
        if resp.status == 404:
            self._rebalance = None
            return []
        if resp.status != 200:
            raise _status_fault(resp, PATH_REBALANCE)
        doc = _json(resp, PATH_REBALANCE)
        if not isinstance(doc, dict) or "noticeTime" not in doc:
            raise Fault("bad_json", f"{PATH_REBALANCE}: expected {{'noticeTime'}}, got {resp.text[:200]!r}")
        if self._rebalance is not None:
            return []
        # A rebalance recommendation has no deadline; an interruption, if one follows,
        # comes with two more minutes, so the VM cannot vanish sooner than that.
        notice = Notice(
            id=stable_id("aws", "rebalance", doc["noticeTime"], now.isoformat()),
            source="aws",
            kind="rebalance",
            deadline=now + SPOT_NOTICE,
            received_at=now,
            detail=resp.text.strip(),
            key="rebalance",
        )
        self._rebalance = _Seen(key="rebalance", id=notice.id)
        return self._emit(notice)

    def _handle_asg(self, resp: Resp, now: datetime) -> list[WatchEvent]:
        if resp.status == 404:
            self._asg = None
            return []
        if resp.status != 200:
            raise _status_fault(resp, PATH_ASG)
        _check_type(resp, PATH_ASG)
        state = resp.text.strip()
        if not state or not set(state) <= _LIFECYCLE_CHARS:
            raise Fault("bad_value", f"{PATH_ASG}: not a lifecycle state: {resp.text[:100]!r}")
        if state != "Terminated":
            self._asg = None
            return []
        if self._asg is not None:
            return []
        # Lifecycle state carries no time: the first sighting identifies this transition.
        notice = Notice(
            id=stable_id("aws", "asg", state, now.isoformat()),
            source="aws",
            kind="termination",
            deadline=now + SPOT_NOTICE,
            received_at=now,
            detail=f"target-lifecycle-state={state}",
            key=f"asg|{state}",
        )
        self._asg = _Seen(key=state, id=notice.id)
        return self._emit(notice)

    def _handle_scheduled(self, resp: Resp, now: datetime) -> list[WatchEvent]:
        if resp.status == 404:
            doc: Any = []
        elif resp.status != 200:
            raise _status_fault(resp, PATH_SCHEDULED)
        else:
            doc = _json(resp, PATH_SCHEDULED)
        if not isinstance(doc, list) or not all(isinstance(e, dict) and isinstance(e.get("EventId"), str) for e in doc):
            raise Fault(
                "bad_json", f"{PATH_SCHEDULED}: expected a list of events with EventId, got {resp.text[:200]!r}"
            )
        out: list[WatchEvent] = []
        listed: set[str] = set()
        bad_dates: list[str] = []
        for event in doc:
            event_id: str = event["EventId"]
            listed.add(event_id)
            state = str(event.get("State", "active")).lower()
            emitted = self._scheduled.setdefault(event_id, {})
            if state in ("completed", "canceled", "cancelled"):
                for notice_id in emitted.values():
                    out.extend(self._cancel(notice_id, f"scheduled event {event_id} {state}"))
                emitted.clear()
                continue
            try:
                not_before = parse_rfc1123(event.get("NotBefore", ""))
            except ValueError:
                bad_dates.append(f"{event_id}: NotBefore={event.get('NotBefore')!r}")
                continue
            code = str(event.get("Code", ""))
            near = code in TERMINATING_CODES and not_before - now <= TERMINATION_THRESHOLD
            kind = "termination" if near else "maintenance"
            if kind in emitted:
                continue
            if near and "maintenance" in emitted:
                log.info("aws_scheduled_escalated", notice_id=emitted["maintenance"], event_id=event_id, code=code)
            notice = Notice(
                id=stable_id("aws", "scheduled", event_id)
                if kind == "maintenance"
                else stable_id("aws", "scheduled", event_id, "termination"),
                source="aws",
                kind=kind,
                deadline=not_before,
                received_at=now,
                detail=json.dumps(event),  # the provider's fields, in its order
                key=f"scheduled|{event_id}|{kind}",
            )
            emitted[kind] = notice.id
            out.extend(self._emit(notice))
        for event_id in [e for e in self._scheduled if e not in listed]:
            # An event gone from the list (after answering 200) is withdrawn too.
            for notice_id in self._scheduled.pop(event_id).values():
                out.extend(self._cancel(notice_id, f"scheduled event {event_id} no longer listed"))
        if bad_dates:
            # Deliver what parsed; the unreadable ones are retried next poll.
            self._error(
                Fault("bad_date", f"{PATH_SCHEDULED}: unreadable NotBefore ({'; '.join(bad_dates)})"),
                path=PATH_SCHEDULED,
            )
        return out
