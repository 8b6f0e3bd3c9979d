"""Azure IMDS: Scheduled Events (with StartRequests approval) and the compute document.

Checks run in IMDS's order: throttling (5 req/s sliding window) first, then the
``Metadata: true`` header, then ``api-version``; errors carry Azure-like JSON.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from aiohttp import web

from ..timefmt import to_rfc1123
from .state import STATE_KEY, EmulatorState, NoticeRecord

__all__ = ["add_routes", "SCHEDULED_EVENTS_VERSIONS", "INSTANCE_VERSIONS"]

SCHEDULED_EVENTS_VERSIONS: frozenset[str] = frozenset(
    {"2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01"}
)
INSTANCE_VERSIONS: frozenset[str] = frozenset(
    {
        "2017-03-01", "2017-04-02", "2017-08-01", "2017-10-01", "2017-12-01", "2018-02-01",
        "2018-04-02", "2018-10-01", "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01",
        "2019-06-04", "2019-08-01", "2019-08-15", "2019-11-01", "2020-06-01", "2020-07-15",
        "2020-09-01", "2020-10-01", "2020-12-01", "2021-01-01", "2021-02-01", "2021-03-01",
        "2021-05-01", "2021-10-01", "2021-11-01", "2021-11-15", "2021-12-13", "2022-02-01",
        "2022-03-01", "2022-05-01", "2022-07-01", "2022-08-01", "2022-09-01", "2023-07-01",
    }
)  # fmt: skip
NEWEST_VERSIONS = ["2023-07-01", "2022-09-01", "2022-08-01"]


def _json(body: Any, status: int = 200) -> web.Response:
    """IMDS labels its JSON ``application/json; charset=utf-8``."""
    return web.Response(text=json.dumps(body), status=status, content_type="application/json", charset="utf-8")


def _error(status: int, message: str, versions: bool = False) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if versions:
        body["newest-versions"] = NEWEST_VERSIONS
    return _json(body, status)


def _check(request: web.Request, known: frozenset[str]) -> Optional[web.Response]:
    """Throttle, header and api-version checks; ``None`` when the request may proceed."""
    state: EmulatorState = request.app[STATE_KEY]
    if not state.azure_allow():
        resp = _error(429, "Too many requests")
        return resp
    if "X-Forwarded-For" in request.headers:
        return _error(400, "Bad request. Request contains X-Forwarded-For header")
    if request.headers.get("Metadata", "").lower() != "true":
        return _error(400, "Bad request. Required metadata header not specified")
    version = request.query.get("api-version")
    if not version:
        return _error(
            400,
            "Bad request. api-version was not specified in the request. For more information refer to aka.ms/azureimds",
            versions=True,
        )
    if version not in known:
        return _error(
            400,
            "Bad request. api-version is invalid or was not specified in the request. "
            "For more information refer to aka.ms/azureimds",
            versions=True,
        )
    return None


def _not_before(state: EmulatorState, rec: NoticeRecord) -> str:
    """RFC 1123 as documented; ``azure_iso_dates`` serves ISO 8601 (``2016-09-19T18:29:47Z``), also seen."""
    if state.config.azure_iso_dates:
        return rec.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
    return to_rfc1123(rec.deadline)


def _event(state: EmulatorState, rec: NoticeRecord, version: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "EventId": rec.id,
        "EventType": rec.event_type,
        "ResourceType": "VirtualMachine",
        "Resources": list(rec.resources),
        "EventStatus": "Scheduled" if rec.status == "active" else "Started",
        "NotBefore": _not_before(state, rec) if rec.status == "active" else "",
        "Description": rec.description,
    }
    if version >= "2020-07-01":
        out["EventSource"] = rec.event_source
        out["DurationInSeconds"] = rec.duration
    return out


def _document(state: EmulatorState, version: str) -> dict[str, Any]:
    events = [_event(state, rec, version) for rec in state.azure_events()]
    return {"DocumentIncarnation": state.azure_incarnation, "Events": events}


async def get_scheduled_events(request: web.Request) -> web.StreamResponse:
    denied = _check(request, SCHEDULED_EVENTS_VERSIONS)
    if denied is not None:
        return denied
    state: EmulatorState = request.app[STATE_KEY]
    return _json(_document(state, request.query["api-version"]))


async def post_scheduled_events(request: web.Request) -> web.StreamResponse:
    """StartRequests approval: starts each named event for every VM it lists."""
    denied = _check(request, SCHEDULED_EVENTS_VERSIONS)
    if denied is not None:
        return denied
    state: EmulatorState = request.app[STATE_KEY]
    try:
        body = json.loads(await request.read() or b"null")
        requests = body["StartRequests"]
        if not isinstance(requests, list):
            raise TypeError("StartRequests must be a list")
        ids = [r["EventId"] for r in requests]
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("EventId must be a string")
    except (ValueError, KeyError, TypeError) as exc:
        return _error(400, f"Bad request. Invalid StartRequests body: {exc}")
    state.azure_approve(ids)
    return web.Response(status=200, content_type="application/json", charset="utf-8", text="")


def _compute(state: EmulatorState) -> dict[str, Any]:
    name = state.config.azure_vm_name
    return {
        "azEnvironment": "AzurePublicCloud",
        "location": "eastus",
        "name": name,
        "osType": "Linux",
        "priority": "Spot",
        "resourceGroupName": "spotguard-rg",
        "resourceId": f"/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/spotguard-rg"
        f"/providers/Microsoft.Compute/virtualMachines/{name}",
        "subscriptionId": "00000000-0000-0000-0000-000000000000",
        "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
        "vmScaleSetName": "",
        "vmSize": "Standard_NC24ads_A100_v4",
        "zone": "1",
    }


async def get_instance(request: web.Request) -> web.StreamResponse:
    """``/metadata/instance[/compute[/leaf]]``; leaves need ``format=text`` like real IMDS."""
    denied = _check(request, INSTANCE_VERSIONS)
    if denied is not None:
        return denied
    state: EmulatorState = request.app[STATE_KEY]
    parts = [p for p in request.path.split("/") if p][2:]  # after "metadata", "instance"
    node: Any = {"compute": _compute(state), "network": {"interface": []}}
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return _error(404, "Not found")
        node = node[part]
    fmt = request.query.get("format", "json")
    if isinstance(node, dict) or isinstance(node, list):
        if fmt != "json":
            return _error(400, "Bad request. Non-leaf nodes can only be returned in json format")
        return _json(node)
    if fmt != "text":
        return _error(400, "Bad request. Leaf nodes must use format=text")
    return web.Response(text=str(node), content_type="text/plain", charset="utf-8")


async def not_found(request: web.Request) -> web.StreamResponse:
    denied = _check(request, INSTANCE_VERSIONS | SCHEDULED_EVENTS_VERSIONS)
    return denied if denied is not None else _error(404, "Not found")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metadata/scheduledevents", get_scheduled_events)
    app.router.add_post("/metadata/scheduledevents", post_scheduled_events)
    app.router.add_get("/metadata/instance", get_instance)
    app.router.add_get("/metadata/instance/{tail:.*}", get_instance)
    app.router.add_get("/metadata/{tail:.*}", not_found)
