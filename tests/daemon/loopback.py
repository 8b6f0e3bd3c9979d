"""A real HTTP server on 127.0.0.1 for the cluster-action tests: records every request,
answers with a programmable script (status sequence, delay, hang)."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Handler = Callable[[web.Request, Seen], Awaitable[web.StreamResponse]]


async def serve(handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
                ssl_context: Optional[ssl.SSLContext] = None) -> tuple[web.AppRunner, int]:
    """Every path and method to ``handle``, on 127.0.0.1 and a free port."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@dataclass
class LoopbackServer:
    """``statuses``: answers in order (the last one repeats); ``delay``: seconds before answering;
    ``hang``: never answer (until the server stops); ``handler``: full control instead."""

    statuses: list[int] = field(default_factory=lambda: [200])
    delay: float = 0.0
    hang: bool = False
    handler: Optional[Handler] = None
    requests: list[Seen] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: Optional[web.AppRunner] = None
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.path, request.query_string, dict(request.headers), await request.read())
        self.requests.append(seen)
        self.arrived.set()
        if self.hang:
            await self._release.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.handler is not None:
            return await self.handler(request, seen)
        status = self.statuses[min(len(self.requests) - 1, len(self.statuses) - 1)]
        return web.json_response({"ok": status < 300}, status=status)

    async def wait_requests(self, n: int, timeout: float = 10.0) -> list[Seen]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while len(self.requests) < n:
            self.arrived.clear()
            left = end - loop.time()
            if left <= 0:
                raise AssertionError(f"expected {n} requests, got {len(self.requests)}")
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                pass
        return self.requests

    async def __aenter__(self) -> "LoopbackServer":
        self._runner, self.port = await serve(self._handle)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._release.set()
        assert self._runner is not None
        await self._runner.cleanup()


async def assert_notices_prompt(push: Callable[[Any], Awaitable[None]], sub: Any, make: Callable[[str], Any],
                                prefix: str, n: int = 3, bound: float = 1.0) -> list[float]:
    """While an action's server hangs: ``n`` more notices each reach the subscriber within ``bound``
    seconds of the watcher yielding them (the usual sub-millisecond fan-out, with room for a loaded box)."""
    import time

    lat = []
    for i in range(n):
        nid = f"{prefix}{i + 1}"
        t0 = time.monotonic()
        await push(make(nid))
        assert (await sub.next_notice(timeout=5)).id == nid
        lat.append(time.monotonic() - t0)
    assert max(lat) < bound, lat
    return lat
