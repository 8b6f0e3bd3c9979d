"""AWS EC2 instance metadata (IMDSv2) as seen from a spot instance.

Like the real IMDS, every answer is ``text/plain`` (JSON documents included) and
errors are small HTML pages, so a watcher that trusts the content type, or
parses error bodies, is caught here rather than on a real VM.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Optional

from aiohttp import web

from .state import STATE_KEY, EmulatorState

__all__ = ["add_routes", "format_aws_date", "TOKEN_HEADER", "TTL_HEADER"]

TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
MAX_TTL = 21600

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

IDENTITY: dict[str, object] = {
    "accountId": "123456789012",
    "architecture": "x86_64",
    "availabilityZone": "us-east-1a",
    "billingProducts": None,
    "devpayProductCodes": None,
    "marketplaceProductCodes": None,
    "imageId": "ami-0abcdef1234567890",
    "instanceId": "i-0123456789abcdef0",
    "instanceType": "p4d.24xlarge",
    "kernelId": None,
    "pendingTime": "2026-01-01T00:00:00Z",
    "privateIp": "10.0.0.10",
    "ramdiskId": None,
    "region": "us-east-1",
    "version": "2017-09-30",
}

META_LEAVES: dict[str, str] = {
    "instance-id": str(IDENTITY["instanceId"]),
    "instance-type": str(IDENTITY["instanceType"]),
    "ami-id": str(IDENTITY["imageId"]),
    "local-ipv4": str(IDENTITY["privateIp"]),
    "placement/availability-zone": str(IDENTITY["availabilityZone"]),
    "placement/region": str(IDENTITY["region"]),
    "instance-life-cycle": "spot",
}


def format_aws_date(dt: datetime) -> str:
    """AWS scheduled-event date: ``21 Jan 2019 09:00:43 GMT`` (day not zero-padded)."""
    d = dt.astimezone(timezone.utc)
    return f"{d.day} {_MONTHS[d.month - 1]} {d.year} {d:%H:%M:%S} GMT"


def _html(status: int, reason: str) -> web.Response:
    body = (
        '<?xml version="1.0" encoding="iso-8859-1"?>\n'
        '<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"\n'
        '\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n'
        '<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">\n'
        f" <head>\n  <title>{status} - {reason}</title>\n </head>\n"
        f" <body>\n  <h1>{status} - {reason}</h1>\n </body>\n</html>\n"
    )
    return web.Response(status=status, text=body, content_type="text/html")


def _text(body: str) -> web.Response:
    return web.Response(text=body, content_type="text/plain")


def _state(request: web.Request) -> EmulatorState:
    return request.app[STATE_KEY]


async def put_token(request: web.Request) -> web.StreamResponse:
    """IMDSv2 session start: TTL 1..21600 or 400; the hop-limit switch makes it hang."""
    state = _state(request)
    if state.config.aws_disabled:
        return _html(403, "Forbidden")
    if state.config.aws_token_put_hang:
        # Hop limit 1 from a container: the PUT's answer never arrives.
        await state.closing.wait()
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=504)
    if "X-Forwarded-For" in request.headers:
        return _html(403, "Forbidden")
    raw = request.headers.get(TTL_HEADER)
    ttl: Optional[int]
    try:
        ttl = int(raw) if raw is not None else None
    except ValueError:
        ttl = None
    if ttl is None or not 1 <= ttl <= MAX_TTL:
        return _html(400, "Bad Request")
    token = state.issue_token(ttl)
    resp = _text(token)
    resp.headers[TTL_HEADER] = str(ttl)
    return resp


def _authorised(request: web.Request) -> Optional[web.Response]:
    """``None`` when the GET may proceed, else the error IMDS would send."""
    state = _state(request)
    if state.config.aws_disabled:
        return _html(403, "Forbidden")
    token = request.headers.get(TOKEN_HEADER)
    if token is None and state.config.aws_imdsv1:
        return None
    if not state.token_valid(token):
        return _html(401, "Unauthorized")
    return None


async def get_metadata(request: web.Request) -> web.StreamResponse:
    """Every ``GET /latest/...``: token check first, then the document."""
    denied = _authorised(request)
    if denied is not None:
        return denied
    state = _state(request)
    path = request.path
    if path == "/latest/dynamic/instance-identity/document":
        return _text(json.dumps(IDENTITY, indent=2))
    prefix = "/latest/meta-data/"
    if not path.startswith(prefix):
        return _html(404, "Not Found")
    leaf = path[len(prefix):]
    if leaf == "spot/instance-action":
        rec = state.aws_spot()
        if rec is None:
            return _html(404, "Not Found")
        return _text(json.dumps({"action": rec.action, "time": state.aws_spot_time(rec)}))
    if leaf == "spot/termination-time":
        rec = state.aws_spot()
        if rec is None or rec.action != "terminate":
            return _html(404, "Not Found")
        return _text(state.aws_spot_time(rec))
    if leaf == "events/recommendations/rebalance":
        rec = state.aws_rebalance()
        if rec is None:
            return _html(404, "Not Found")
        return _text(json.dumps({"noticeTime": rec.created.strftime("%Y-%m-%dT%H:%M:%SZ")}))
    if leaf == "events/maintenance/scheduled":
        events = [
            {
                "NotBefore": format_aws_date(rec.deadline),
                "Code": rec.code,
                "Description": rec.description,
                "EventId": rec.id,
                "NotAfter": format_aws_date(rec.deadline + timedelta(minutes=17)),
                "NotBeforeDeadline": format_aws_date(rec.deadline + timedelta(days=7)),
                "State": rec.status,
            }
            for rec in state.aws_scheduled()
        ]
        return _text(json.dumps(events, indent=2))
    if leaf == "autoscaling/target-lifecycle-state":
        value = state.aws_lifecycle()
        return _html(404, "Not Found") if value is None else _text(value)
    if leaf in META_LEAVES:
        return _text(META_LEAVES[leaf])
    if leaf == "":
        return _text("\n".join(["ami-id", "autoscaling/", "events/", "instance-id", "instance-type", "placement/", "spot/"]))
    return _html(404, "Not Found")


def add_routes(app: web.Application) -> None:
    app.router.add_put("/latest/api/token", put_token)
    app.router.add_get("/latest/{tail:.*}", get_metadata)

