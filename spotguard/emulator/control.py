"""The ``/_emulator/*`` control API, request counting and fault injection.

Faults are applied in a middleware *before* any cloud logic (auth, throttling),
because a broken metadata server fails before it looks at your token.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from ..logs import get_logger

log = get_logger("spotguard.emulator")
from .state import STATE_KEY, ControlError, EmulatorState, Fault, cloud_of_path

__all__ = ["add_routes", "count_middleware", "fault_middleware", "CONTROL_PREFIX"]

CONTROL_PREFIX = "/_emulator"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# What a "malformed" answer looks like per cloud: the start of a real document, cut off.
_MALFORMED: dict[Optional[str], tuple[bytes, str]] = {
    "aws": (b'{"action": "terminate", "time": "20', "text/plain"),
    "gcp": (b"TR\x00UE\xff<garbage", "text/plain"),
    "azure": (b'{"DocumentIncarnation": 7, "Events": [{"EventId": "', "application/json"),
    None: (b'{"garbage', "application/json"),
}


def _is_control(request: web.Request) -> bool:
    return request.path == CONTROL_PREFIX or request.path.startswith(CONTROL_PREFIX + "/")


@web.middleware
async def count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every cloud request as ``METHOD path`` and keep a short log tail."""
    if _is_control(request):
        return await handler(request)
    state: EmulatorState = request.app[STATE_KEY]
    entry = state.count_request(request.method, request.path, request.query_string)
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        entry["status"] = exc.status
        raise
    entry["status"] = resp.status
    return resp


def _reset_connection(request: web.Request) -> None:
    """Abort with SO_LINGER 0, so the client sees a TCP RST rather than a tidy close."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def _apply(fault: Fault, request: web.Request, handler: Handler, state: EmulatorState) -> web.StreamResponse:
    mode = fault.mode
    if mode == "status":
        resp = web.Response(status=fault.status, text=f"{fault.status} injected by spotguard emulator\n")
        if fault.retry_after is not None or fault.status == 429:
            resp.headers["Retry-After"] = str(fault.retry_after if fault.retry_after is not None else 1)
        return resp
    if mode == "hang":
        await state.closing.wait()  # until the client gives up (handler cancelled) or shutdown
        _reset_connection(request)
        return web.Response(status=504)
    if mode == "reset":
        _reset_connection(request)
        return web.Response(status=500)  # never delivered: the transport is gone
    if mode == "malformed":
        body, ctype = _MALFORMED.get(cloud_of_path(request.path), _MALFORMED[None])
        return web.Response(status=200, body=body, content_type=ctype)
    if mode == "slow":
        try:
            await asyncio.wait_for(state.closing.wait(), fault.delay)
        except asyncio.TimeoutError:
            pass
        return await handler(request)
    # content_type: the right body, the wrong label
    answer = await handler(request)
    if isinstance(answer, web.Response):
        answer.content_type = "text/html"
    return answer


@web.middleware
async def fault_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Apply the first matching injected fault (consuming one of its ``count``)."""
    if _is_control(request):
        return await handler(request)
    state: EmulatorState = request.app[STATE_KEY]
    fault = state.take_fault(cloud_of_path(request.path), request.path)
    if fault is None:
        return await handler(request)
    log.debug("fault_applied", fault=fault.id, mode=fault.mode, path=request.path)
    return await _apply(fault, request, handler, state)


# ----- control endpoints ----------------------------------------------------------


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ControlError(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ControlError("body must be a JSON object")
    return data


def _guard(fn: Callable[[web.Request, EmulatorState, dict[str, Any]], Any]) -> Handler:
    """Parse the body, run the action, map ControlError/TypeError to a JSON 400."""

    async def handler(request: web.Request) -> web.StreamResponse:
        state: EmulatorState = request.app[STATE_KEY]
        try:
            body = await _body(request) if request.method == "POST" else {}
            result = fn(request, state, body)
        except (ControlError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(result)

    return handler


def _notice(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    allowed = {"cloud", "kind", "in_seconds", "action", "code", "description", "event_type", "resources",
               "event_source", "duration"}  # fmt: skip
    unknown = set(body) - allowed
    if unknown:
        raise ControlError(f"unknown notice fields: {', '.join(sorted(unknown))}")
    if "cloud" not in body or "kind" not in body:
        raise ControlError("notice needs cloud and kind")
    rec = state.add_notice(**body)
    log.info("notice_scheduled", **rec.to_dict())
    return rec.to_dict()


def _cancel(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    ids = state.cancel(body.get("cloud"), body.get("id"), body.get("state", "canceled"))
    log.info("notice_cancelled", ids=ids)
    return {"cancelled": ids}


def _fault(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    allowed = {"cloud", "path", "mode", "status", "delay", "count", "retry_after"}
    unknown = set(body) - allowed
    if unknown:
        raise ControlError(f"unknown fault fields: {', '.join(sorted(unknown))}")
    if "mode" not in body:
        raise ControlError("fault needs a mode")
    fault = state.add_fault(**body)
    log.info("fault_added", **fault.to_dict())
    return {"id": fault.id, "fault": fault.to_dict()}


def _fault_clear(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    return {"cleared": state.clear_faults(body.get("id"))}


def _config(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    if body:
        state.config.update(body)
        log.info("config_changed", **body)
    return {"config": state.config.to_dict()}


def _reset(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    state.reset()
    log.info("reset")
    return {"ok": True}


def _state(request: web.Request, state: EmulatorState, body: dict[str, Any]) -> dict[str, Any]:
    return state.snapshot()


def add_routes(app: web.Application) -> None:
    p = CONTROL_PREFIX
    app.router.add_post(f"{p}/notice", _guard(_notice))
    app.router.add_post(f"{p}/cancel", _guard(_cancel))
    app.router.add_post(f"{p}/fault", _guard(_fault))
    app.router.add_post(f"{p}/fault/clear", _guard(_fault_clear))
    app.router.add_post(f"{p}/config", _guard(_config))
    app.router.add_get(f"{p}/config", _guard(_config))
    app.router.add_post(f"{p}/reset", _guard(_reset))
    app.router.add_get(f"{p}/state", _guard(_state))
