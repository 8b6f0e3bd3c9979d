"""Fixtures for the cloud watcher tests: a real emulator on a free port and a collector
that drains a watcher in the background (so "nothing arrived" can be asserted
without cancelling the watcher's async generator)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

import pytest

from spotguard.daemon.watchers.base import Watcher
from spotguard.emulator.server import Emulator, running_emulator
from spotguard.notice import Cancel, Notice, WatchEvent


class Collector:
    """Runs ``watcher.events()`` in a task; events land in a queue with their arrival time."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.queue: asyncio.Queue[tuple[float, WatchEvent]] = asyncio.Queue()
        self.seen: list[WatchEvent] = []
        self.error: Optional[BaseException] = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for event in self.watcher.events():
                self.seen.append(event)
                self.queue.put_nowait((time.monotonic(), event))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the contract: events() never raises
            self.error = exc
            raise

    async def next(self, timeout: float = 5.0) -> WatchEvent:
        return (await self.next_timed(timeout))[1]

    async def next_timed(self, timeout: float = 5.0) -> tuple[float, WatchEvent]:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def next_notice(self, timeout: float = 5.0) -> Notice:
        event = await self.next(timeout)
        assert isinstance(event, Notice), event
        return event

    async def next_cancel(self, timeout: float = 5.0) -> Cancel:
        event = await self.next(timeout)
        assert isinstance(event, Cancel), event
        return event

    def assert_empty(self) -> None:
        assert self.queue.empty(), f"unexpected events: {list(self.queue._queue)}"  # type: ignore[attr-defined]
        assert self.error is None, self.error

    async def stop(self) -> None:
        await asyncio.wait_for(self.watcher.close(), 5)
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 3)
        except asyncio.TimeoutError:
            self.task.cancel()
            pytest.fail("watcher did not stop within 3 s of close()")
        assert self.error is None, self.error


@pytest.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with running_emulator(port=0) as emulator:
        yield emulator


@pytest.fixture
async def collect() -> AsyncIterator[Callable[[Watcher], Collector]]:
    """``collect(watcher)`` starts draining; every collector is stopped at teardown."""
    made: list[Collector] = []

    def start(watcher: Watcher) -> Collector:
        c = Collector(watcher)
        made.append(c)
        return c

    yield start
    for c in made:
        await c.stop()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def _wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """For state that has no awaitable (health counters); polls every 10 ms."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


WaitUntil = Callable[..., Awaitable[None]]


@pytest.fixture
def wait_until() -> WaitUntil:
    return _wait_until


async def refused_then_server_appears(collect: Callable[[Watcher], Collector], w: Watcher, url: str,
                                      cloud: str, kind: str, in_seconds: Optional[float] = None) -> None:
    """``w`` watches ``url`` (see ``closed_port_url``): ``connection_refused`` errors while nothing
    listens; then an emulator starts on that port with a ``kind`` notice, which the watcher
    delivers, and it is healthy again."""
    c = collect(w)
    await _wait_until(lambda: w.health.errors_by_reason.get("connection_refused", 0) >= 2, what="refused errors")
    assert "cannot connect" in (w.health.last_error or "")
    port = int(url.rsplit(":", 1)[1])
    async with running_emulator(port=port) as emu:
        emu.notice(cloud, kind, in_seconds)
        assert (await c.next_notice(timeout=3)).kind == kind
        await _wait_until(lambda: w.health.healthy, what="recovery")
        await c.stop()
