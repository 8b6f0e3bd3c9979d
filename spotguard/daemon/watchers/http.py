"""HTTP plumbing shared by the metadata-service watchers (AWS, Azure, GCP).

One exchange with a metadata endpoint either returns a ``Resp`` or raises a
``Fault``: a short metrics label (``timeout``, ``http_503``, ``bad_json``...),
a message and, where there is one, the fix to log. What a status code means,
and the texts that say so, stay with each cloud's watcher.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import aiohttp

from .base import Watcher

__all__ = ["Fault", "Resp", "HttpWatcher", "request", "retry_after", "is_html", "reject_html", "parse_json"]


class Fault(Exception):
    """One bad response: a metrics label, a message and, where there is one, the fix."""

    def __init__(self, reason: str, message: str, fix: Optional[str] = None, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.fix = fix
        self.retry_after = retry_after


@dataclass
class Resp:
    status: int
    text: str
    content_type: str
    headers: Mapping[str, str]


def retry_after(headers: Mapping[str, str]) -> float:
    """The ``Retry-After`` seconds of an answer, within 0..60 (0 when absent or unreadable)."""
    value = headers.get("Retry-After")
    if not value:
        return 0.0
    try:
        return max(0.0, min(float(value), 60.0))
    except ValueError:
        return 0.0


async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    timeout: float,
    unreachable_fix: str,
    params: Optional[Mapping[str, str]] = None,
    body: Optional[dict[str, Any]] = None,
) -> Resp:
    """One HTTP exchange; every transport failure becomes a labelled ``Fault``.

    ``unreachable_fix`` is the hint logged when nothing listens at ``url``."""
    try:
        async with session.request(
            method,
            url,
            params=None if params is None else dict(params),
            headers=dict(headers),
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
        ) as resp:
            raw = await resp.read()
            return Resp(
                resp.status, raw.decode("utf-8", errors="replace"), resp.headers.get("Content-Type", ""), resp.headers
            )
    except asyncio.TimeoutError:
        raise Fault("timeout", f"no answer from {url} within {timeout:g}s") from None
    except aiohttp.ClientConnectorError as exc:
        raise Fault("connection_refused", f"cannot connect to {url}: {exc.os_error}", unreachable_fix) from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise Fault("connection_reset", f"connection to {url} dropped: {exc!r}") from None
    except aiohttp.ClientPayloadError as exc:
        raise Fault("bad_body", f"truncated body from {url}: {exc}") from None
    except aiohttp.ClientError as exc:
        raise Fault("http_error", f"{method} {url} failed: {exc!r}") from None


def is_html(resp: Resp) -> bool:
    """An HTML page where metadata was expected: a proxy or captive portal answered."""
    return resp.content_type.lower().startswith("text/html")


def reject_html(resp: Resp, what: str, *, expected: str, fix: str) -> None:
    """Raise a ``content_type`` fault when ``what`` answered HTML instead of ``expected``."""
    if is_html(resp):
        raise Fault("content_type", f"{what} answered {resp.content_type!r}, not {expected}", fix)


def parse_json(resp: Resp, what: str) -> Any:
    try:
        return json.loads(resp.text)
    except ValueError as exc:
        raise Fault("bad_json", f"{what} answered malformed JSON: {exc}") from None


class HttpWatcher(Watcher):
    """A watcher that talks to a metadata endpoint: one proxy-free session, and a ``close`` that
    ends it and interrupts ``_sleep``."""

    def __init__(self) -> None:
        super().__init__()
        self._session: Optional[aiohttp.ClientSession] = None
        self._closed = asyncio.Event()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # trust_env=False: an HTTP(S)_PROXY meant for the internet must never see metadata
            # traffic (Microsoft requires IMDS requests to bypass proxies, and the GCE metadata
            # server refuses the X-Forwarded-For a proxy adds).
            self._session = aiohttp.ClientSession(trust_env=False)
        return self._session

    async def _close_session(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def close(self) -> None:
        self._closed.set()
        await self._close_session()

    async def _sleep(self, seconds: float) -> None:
        """Sleep that ``close`` interrupts."""
        if seconds <= 0:
            return
        try:
            await asyncio.wait_for(self._closed.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
