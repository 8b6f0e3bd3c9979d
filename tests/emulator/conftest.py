"""Fixtures for the emulator tests: a live emulator on a free port and a client session."""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from spotguard.emulator.server import Emulator, running_emulator

GetToken = Callable[..., Awaitable[str]]


@pytest.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with running_emulator(port=0) as emulator:
        yield emulator


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
def aws_token(http: aiohttp.ClientSession, emu: Emulator) -> GetToken:
    """``await aws_token(ttl=...)``: a fresh IMDSv2 token from the emulator."""

    async def get(ttl: int = 21600) -> str:
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}
        async with http.put(f"{emu.url}/latest/api/token", headers=headers) as r:
            assert r.status == 200
            return await r.text()

    return get
