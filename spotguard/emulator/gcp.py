"""GCP Compute Engine metadata server, with true hanging GETs.

``wait_for_change`` blocks on an ``asyncio.Event`` that the state swaps and sets
on every change, so a waiting watcher is answered within the same loop
iteration as the control call: that is what the GCP latency budget measures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, Optional, Union

from aiohttp import web

from .state import STATE_KEY, EmulatorState

__all__ = ["add_routes", "etag_of", "PREFIX"]

PREFIX = "/computeMetadata/v1/"
PROJECT_NUMBER = "123456789012"

Tree = dict[str, Union[str, "Tree"]]


def _static_tree() -> Tree:
    return {
        "instance": {
            "hostname": "spot-vm-0.us-central1-a.c.spotguard-emulator.internal",
            "id": "4520031799277581759",
            "machine-type": f"projects/{PROJECT_NUMBER}/machineTypes/a2-highgpu-1g",
            "maintenance-event": "NONE",
            "name": "spot-vm-0",
            "preempted": "FALSE",
            "scheduling": {
                "automatic-restart": "FALSE",
                "on-host-maintenance": "TERMINATE",
                "preemptible": "TRUE",
                "provisioning-model": "SPOT",
            },
            "zone": f"projects/{PROJECT_NUMBER}/zones/us-central1-a",
        },
        "project": {"numeric-project-id": PROJECT_NUMBER, "project-id": "spotguard-emulator"},
    }


def etag_of(body: bytes) -> str:
    """Content-derived, 16 hex digits like the real server's."""
    return hashlib.sha256(body).hexdigest()[:16]


def _camel(key: str) -> str:
    head, *rest = key.split("-")
    return head + "".join(p.capitalize() for p in rest)


def _to_json(node: Union[str, Tree]) -> Any:
    if isinstance(node, str):
        return node
    return {_camel(k): _to_json(v) for k, v in node.items()}


def _tree(state: EmulatorState) -> Tree:
    tree = _static_tree()
    instance = tree["instance"]
    assert isinstance(instance, dict)
    instance.update(state.gcp_values())
    upcoming = state.gcp_upcoming_maintenance()
    if upcoming is not None:
        instance["upcoming-maintenance"] = json.dumps(upcoming, indent=2)
    return tree


def _render(state: EmulatorState, rel: str, recursive: bool) -> Optional[tuple[bytes, str]]:
    """Body and content type for a path below ``/computeMetadata/v1/``; None = 404."""
    node: Union[str, Tree] = _tree(state)
    for part in [p for p in rel.split("/") if p]:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, str):
        return node.encode(), "text/plain"
    if recursive:
        return json.dumps(_to_json(node), separators=(",", ":")).encode(), "application/json"
    listing = "".join(f"{k}/\n" if isinstance(v, dict) else f"{k}\n" for k, v in node.items())
    return listing.encode(), "text/plain"


def _html(status: int, title: str, message: str) -> web.Response:
    body = (
        "<!DOCTYPE html>\n<html lang=en>\n  <meta charset=utf-8>\n"
        f"  <title>Error {status} ({title})!!1</title>\n"
        f"  <p><b>{status}.</b> <ins>That\u2019s an error.</ins>\n  <p>{message}  <ins>That\u2019s all we know.</ins>\n"
    )
    resp = web.Response(status=status, text=body, content_type="text/html")
    resp.headers["Metadata-Flavor"] = "Google"
    return resp


def _answer(body: bytes, content_type: str) -> web.Response:
    resp = web.Response(body=body, content_type=content_type)
    resp.headers["ETag"] = etag_of(body)
    resp.headers["Metadata-Flavor"] = "Google"
    return resp


def _flag(value: Optional[str], name: str) -> bool:
    if value is None:
        return False
    low = value.lower()
    if low not in ("true", "false"):
        raise ValueError(f"{name} must be true or false")
    return low == "true"


async def get_value(request: web.Request) -> web.StreamResponse:
    """Any ``GET /computeMetadata/v1/...``, plain or hanging."""
    state: EmulatorState = request.app[STATE_KEY]
    if "X-Forwarded-For" in request.headers or request.headers.get("Metadata-Flavor") != "Google":
        return _html(
            403,
            "Forbidden",
            f"Your client does not have permission to get URL <code>{request.path}</code> from this server."
            " Missing Metadata-Flavor:Google header.",
        )
    rel = request.path[len(PREFIX):]
    q = request.query
    try:
        recursive = _flag(q.get("recursive"), "recursive")
        wait = _flag(q.get("wait_for_change"), "wait_for_change")
        timeout: Optional[float] = None
        if "timeout_sec" in q:
            timeout = float(int(q["timeout_sec"]))
            if timeout < 1:
                raise ValueError("timeout_sec must be >= 1")
    except ValueError as exc:
        return _html(400, "Bad Request", f"Your client has issued a malformed or illegal request: {exc}.")
    rendered = _render(state, rel, recursive)
    if rendered is None:
        return _html(404, "Not Found", f"The requested URL <code>{request.path}</code> was not found on this server.")
    if not wait or state.config.gcp_ignore_wait:
        return _answer(*rendered)
    baseline = q.get("last_etag") or etag_of(rendered[0])
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        changed = state.gcp_change_event()  # taken before rendering: no lost wake-up
        current = _render(state, rel, recursive)
        if current is None:
            return _html(404, "Not Found", f"The requested URL <code>{request.path}</code> was not found.")
        if etag_of(current[0]) != baseline or state.closing.is_set():
            return _answer(*current)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return _answer(*current)
        try:
            await asyncio.wait_for(changed.wait(), left)
        except asyncio.TimeoutError:
            return _answer(*_render(state, rel, recursive) or current)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/computeMetadata/v1/{tail:.*}", get_value)
