"""GCP Compute Engine metadata watcher: hanging GETs, no polling.

Two concurrent ``wait_for_change`` requests (``instance/preempted`` and
``instance/maintenance-event``) each start from a plain GET's ETag and then hang
with ``last_etag``, so a change is seen within milliseconds. Per-path token
buckets mean that even a server that ignores ``wait_for_change`` and answers at
once can never cause a busy loop (an unchanged-ETag answer: burst 5, then one
request per ``min_interval``), while real changes are followed without delay.

Notice ids: path + value + the ETag at which the value turned on + the time it was
first seen (the ETag is content-derived, so it alone would repeat for a second
occurrence); the notice is remembered while the value stays on, and a value
going back yields ``Cancel``.

Deadlines: ``preempted`` 30 s; ``maintenance-event`` the start of the window in
``instance/upcoming-maintenance`` when that answers (GPU VMs hear of host
maintenance about an hour ahead), else 60 s. A 404 on a notice path is what GKE's
metadata server (Workload Identity, Autopilot) answers: logged with the fix, and
the watcher is reported blind to health checks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, AsyncIterator, Optional

from ...logs import get_logger
from ...notice import Cancel, Notice, WatchEvent, stable_id
from ...timefmt import parse_rfc3339, to_rfc3339, utcnow
from .base import Backoff
from .http import Fault, HttpWatcher, Resp, is_html, reject_html, request

__all__ = ["GcpWatcher", "PATH_PREFIX", "PREEMPTED", "MAINTENANCE", "UPCOMING", "GKE_METADATA_FIX",
           "parse_window_start"]


log = get_logger("spotguard.watchers.gcp")

PATH_PREFIX = "/computeMetadata/v1/"
PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
NAME = "instance/name"
UPCOMING = "instance/upcoming-maintenance"
# How long the upcoming-maintenance read may hold a maintenance notice back before the fixed 60 s is used.
UPCOMING_TIMEOUT = 1.0
HEADERS = {"Metadata-Flavor": "Google"}

# value -> (kind, notice length); values absent here (FALSE, NONE) mean "no notice".
_ON_VALUES: dict[str, dict[str, tuple[str, timedelta]]] = {
    PREEMPTED: {"TRUE": ("preemption", timedelta(seconds=30))},
    MAINTENANCE: {
        "TERMINATE_ON_HOST_MAINTENANCE": ("termination", timedelta(seconds=60)),
        "MIGRATE_ON_HOST_MAINTENANCE": ("maintenance", timedelta(seconds=60)),
    },
}
_OFF_VALUES: dict[str, frozenset[str]] = {PREEMPTED: frozenset({"FALSE"}), MAINTENANCE: frozenset({"NONE"})}
_NAME_ATTEMPTS = 5


@dataclass
class _Active:
    value: str
    id: str


class _TokenBucket:
    """Burst ``capacity`` requests, then one per ``interval``: the anti-busy-loop guard."""

    def __init__(self, capacity: float, interval: float) -> None:
        self.capacity = capacity
        self.interval = interval
        self.tokens = capacity
        self.stamp = time.monotonic()

    def wait_time(self) -> float:
        now = time.monotonic()
        if self.interval > 0:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) / self.interval)
        else:
            self.tokens = self.capacity
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        wait = (1.0 - self.tokens) * self.interval
        self.tokens -= 1.0  # paid in advance; the refill during the wait covers it
        return wait


# GKE's metadata server (what pods see under Workload Identity, and on Autopilot) serves a subset
# of the instance metadata: ``instance/preempted`` answers 404 there, forever.
GKE_METADATA_FIX = (
    "this looks like the GKE metadata server (Workload Identity / Autopilot), which does not serve "
    "instance/preempted: run the daemon as the hostNetwork DaemonSet (deploy/kubernetes/daemonset), "
    "which reaches the VM's own metadata server; GKE Autopilot forbids hostNetwork (no notices there, "
    "see docs/deploy.md)"
)


def _status_fault(status: int, path: str) -> Fault:
    if status == 404:
        return Fault("http_404", f"metadata server answered 404 on {path}", GKE_METADATA_FIX)
    if status == 503:
        return Fault(
            "http_503", f"metadata server answered 503 on {path}", "brief unavailability during maintenance; retrying"
        )
    if status == 403:
        return Fault(
            "http_403",
            f"metadata server answered 403 on {path}",
            "the request lost its Metadata-Flavor header or went through a proxy (X-Forwarded-For); bypass proxies",
        )
    if status == 429:
        return Fault("http_429", f"metadata server throttled {path}")
    return Fault(f"http_{status}", f"metadata server answered {status} on {path}")


def parse_window_start(text: str) -> Optional[datetime]:
    """``windowStartTime`` (or the snake_case ``window_start_time``) of an upcoming-maintenance document."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    for key in ("windowStartTime", "window_start_time", "latestWindowStartTime", "latest_window_start_time"):
        value = doc.get(key)
        if isinstance(value, str) and value:
            try:
                return parse_rfc3339(value)
            except ValueError:
                return None
    return None


class GcpWatcher(HttpWatcher):
    """Hanging-GET watcher; ``node`` is the instance name (best effort)."""

    source = "gcp"

    def __init__(
        self,
        base_url: str = "http://metadata.google.internal",
        *,
        wait_timeout_sec: int = 60,
        request_timeout: float = 5.0,
        min_interval: float = 0.5,
        backoff_cap: float = 5.0,
    ) -> None:
        super().__init__()
        if wait_timeout_sec < 1:
            raise ValueError(f"wait_timeout_sec must be ≥ 1, got {wait_timeout_sec}")
        base = base_url.rstrip("/")
        if base.endswith(PATH_PREFIX.rstrip("/")):
            base = base[: -len(PATH_PREFIX.rstrip("/"))]
        self.base_url = base
        self.wait_timeout_sec = int(wait_timeout_sec)
        self.request_timeout = request_timeout
        self.min_interval = min_interval
        self.backoff_cap = backoff_cap
        self.node: Optional[str] = None
        self._queue: asyncio.Queue[Optional[WatchEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._active: dict[str, _Active] = {}
        self._yielded: set[str] = set()
        self._occurrences = itertools.count(1)
        self._warned: set[str] = set()
        self._windows: dict[str, tuple[datetime, str]] = {}  # path -> (window start, raw upcoming-maintenance)
        self.health.require(PREEMPTED, MAINTENANCE)
        # A hanging GET answers at least every wait_timeout_sec: allow two of them, and a margin.
        self.health.stale_floor = 2 * self.wait_timeout_sec + 30

    async def _get(self, path: str, params: dict[str, str], timeout: float) -> Resp:
        return await request(
            self._get_session(),
            "GET",
            self.base_url + PATH_PREFIX + path,
            params=params,
            headers=HEADERS,
            timeout=timeout,
            unreachable_fix="is this a GCE VM? check --metadata-url",
        )

    async def close(self) -> None:
        self._closed.set()
        self._queue.put_nowait(None)
        await self._stop_tasks()
        await self._close_session()

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # already logged by the task
                    pass

    def _error(self, path: str, fault: Fault) -> None:
        was_ok = self.health.paths[path].ok if path in self.health.paths else True
        self.health.error(fault.reason, fault.message, fault.fix, path=path)
        fields: dict[str, Any] = {"reason": fault.reason, "error": fault.message, "path": path}
        if fault.fix:
            fields["fix"] = fault.fix
        # One warning when a path turns bad (or its reason changes), then debug: a GKE 404 is forever.
        if was_ok or fault.reason not in self._warned:
            log.warning("gcp_poll_error", **fields)
        else:
            log.debug("gcp_poll_error", **fields)
        self._warned.add(fault.reason)

    def _ok(self, path: str) -> None:
        ph = self.health.paths.get(path)
        if ph is not None and not ph.ok and ph.last_error is not None:
            log.info("gcp_poll_recovered", path=path)
        self.health.ok(path)

    async def events(self) -> AsyncIterator[WatchEvent]:
        """Run both hanging GETs in the background and yield what they find until ``close``."""
        log.info("gcp_watcher_started", base_url=self.base_url, wait_timeout_sec=self.wait_timeout_sec)
        self._tasks = [
            asyncio.create_task(self._watch(PREEMPTED), name="gcp-preempted"),
            asyncio.create_task(self._watch(MAINTENANCE), name="gcp-maintenance-event"),
            asyncio.create_task(self._fetch_name(), name="gcp-name"),
        ]
        try:
            while not self._closed.is_set():
                event = await self._queue.get()
                if event is None:
                    break
                yield event
        finally:
            await self._stop_tasks()
            await self._close_session()

    async def _fetch_name(self) -> None:
        """Best effort: the instance name for ``hello`` and logs."""
        backoff = Backoff(base=0.2, cap=self.backoff_cap)
        for _ in range(_NAME_ATTEMPTS):
            try:
                resp = await self._get(NAME, {}, self.request_timeout)
                if resp.status == 200 and resp.text.strip() and not is_html(resp):
                    self.node = resp.text.strip()
                    log.info("gcp_identity", node=self.node)
                    return
                log.debug("gcp_name_unavailable", status=resp.status)
            except Fault as fault:
                log.debug("gcp_name_unavailable", reason=fault.reason, error=fault.message)
            await self._sleep(backoff.next_delay())
            if self._closed.is_set():
                return

    async def _watch(self, path: str) -> None:
        """One path: plain GET for the first ETag, then hanging GETs with ``last_etag``."""
        backoff = Backoff(base=0.1, cap=self.backoff_cap)
        # An answer with an unchanged ETag (timeout_sec expired, or a server that ignores
        # wait_for_change) was unproductive: re-asking is paced by ``min_interval``. An
        # answer with a new ETag is re-issued at once (nothing to wait for), bounded only
        # by a looser bucket in case a server changed its ETag on every answer.
        unproductive = _TokenBucket(capacity=5, interval=self.min_interval)
        changed = _TokenBucket(capacity=10, interval=min(0.1, self.min_interval))
        bucket: Optional[_TokenBucket] = None
        etag: Optional[str] = None
        warned_no_etag = False
        while not self._closed.is_set():
            if bucket is not None:
                await self._sleep(bucket.wait_time())
            if self._closed.is_set():
                return
            if etag is None:
                params: dict[str, str] = {}
                timeout = self.request_timeout
            else:
                params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(self.wait_timeout_sec)}
                timeout = self.wait_timeout_sec + self.request_timeout
            try:
                resp = await self._get(path, params, timeout)
                value = self._parse(path, resp)
            except Fault as fault:
                self._error(path, fault)
                await self._sleep(backoff.next_delay())
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not end the watch
                self.health.error("internal", repr(exc))
                log.exception("gcp_watcher_internal_error", path=path, error=repr(exc))
                await self._sleep(backoff.next_delay())
                continue
            backoff.reset()
            self._ok(path)
            new_etag = resp.headers.get("ETag")
            if not new_etag and not warned_no_etag:
                warned_no_etag = True
                log.warning("gcp_no_etag", path=path, error="response without ETag; falling back to paced plain GETs")
            if path == MAINTENANCE and value in _ON_VALUES[MAINTENANCE]:
                active = self._active.get(path)
                if active is None or active.value != value:
                    await self._read_window()
            self._observe(path, value, new_etag or "", resp.text.strip())
            bucket = changed if new_etag and new_etag != etag else unproductive
            etag = new_etag or None

    async def _read_window(self) -> None:
        """``instance/upcoming-maintenance`` (best effort, <= ``UPCOMING_TIMEOUT``): GPU VMs are told about
        host maintenance about an hour ahead, and the window's start, not a fixed 60 s, is the deadline."""
        try:
            resp = await self._get(UPCOMING, {}, UPCOMING_TIMEOUT)
        except Fault as fault:
            log.info("gcp_upcoming_maintenance_unavailable", reason=fault.reason, error=fault.message,
                     assumed="60s from now")
            return
        if resp.status != 200:
            log.info("gcp_upcoming_maintenance_unavailable", status=resp.status, assumed="60s from now")
            return
        start = parse_window_start(resp.text)
        if start is None:
            log.warning("gcp_upcoming_maintenance_unreadable", body=resp.text[:300], assumed="60s from now")
            return
        self._windows[MAINTENANCE] = (start, " ".join(resp.text.split())[:1000])

    def _parse(self, path: str, resp: Resp) -> str:
        if resp.status != 200:
            raise _status_fault(resp.status, path)
        reject_html(resp, path, expected="metadata", fix="bypass HTTP proxies for the metadata server")
        value = resp.text.strip()
        if value not in _ON_VALUES[path] and value not in _OFF_VALUES[path]:
            raise Fault("bad_value", f"{path}: unexpected value {resp.text[:100]!r}")
        return value

    def _observe(self, path: str, value: str, etag: str, raw: str) -> None:
        now = utcnow()
        active = self._active.get(path)
        if active is not None and active.value == value:
            return
        if active is not None:
            del self._active[path]
            self._yielded.discard(active.id)
            log.info("notice_cancelled", notice_id=active.id, source="gcp", path=path, value=value)
            self._queue.put_nowait(Cancel(id=active.id, source="gcp", detail=f"{path}={value}"))
        on = _ON_VALUES[path].get(value)
        if on is None:
            return
        kind, length = on
        deadline, detail = now + length, f"{path}={raw}"
        window = self._windows.pop(path, None)
        if window is not None and window[0] > now:
            deadline, detail = window[0], f"{detail}; {UPCOMING}={window[1]}"
        notice = Notice(
            # The ETag is content-derived (the same value has the same ETag every time),
            # so the first-seen time tells two occurrences apart; remembered while on.
            id=stable_id("gcp", path, value, etag, now.isoformat(), next(self._occurrences)),
            source="gcp",
            kind=kind,
            deadline=deadline,
            received_at=now,
            detail=detail,
            key=f"{path}|{value}|{etag}",
        )
        self._active[path] = _Active(value=value, id=notice.id)
        if notice.id in self._yielded:
            return
        self._yielded.add(notice.id)
        log.info(
            "notice_seen",
            notice_id=notice.id,
            source="gcp",
            kind=kind,
            deadline=to_rfc3339(notice.deadline),
            detail=notice.detail,
        )
        self._queue.put_nowait(notice)
