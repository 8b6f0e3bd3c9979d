"""AWS IMDSv2 emulation: tokens, their failure modes, and every notice endpoint."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta
from typing import Awaitable, Callable

import aiohttp
import pytest

from spotguard.emulator.server import Emulator

GetToken = Callable[..., Awaitable[str]]
from spotguard.timefmt import parse_rfc1123, parse_rfc3339, utcnow

TTL = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN = "X-aws-ec2-metadata-token"
SPOT = "/latest/meta-data/spot/instance-action"


async def _get(http: aiohttp.ClientSession, emu: Emulator, path: str, token: str | None) -> tuple[int, str, str]:
    headers = {TOKEN: token} if token else {}
    async with http.get(emu.url + path, headers=headers) as r:
        return r.status, r.content_type, await r.text()


@pytest.mark.parametrize("ttl", ["0", "21601", "-5", "abc", None])
async def test_token_ttl_out_of_bounds_is_400(emu: Emulator, http: aiohttp.ClientSession, ttl: str | None) -> None:
    headers = {TTL: ttl} if ttl is not None else {}
    async with http.put(f"{emu.url}/latest/api/token", headers=headers) as r:
        assert r.status == 400


@pytest.mark.parametrize("ttl", ["1", "21600"])
async def test_token_ttl_bounds_accepted_and_echoed(emu: Emulator, http: aiohttp.ClientSession, ttl: str) -> None:
    async with http.put(f"{emu.url}/latest/api/token", headers={TTL: ttl}) as r:
        assert r.status == 200
        assert r.headers[TTL] == ttl
        assert len(await r.text()) > 20


async def test_token_put_with_x_forwarded_for_is_refused(emu: Emulator, http: aiohttp.ClientSession) -> None:
    async with http.put(f"{emu.url}/latest/api/token", headers={TTL: "60", "X-Forwarded-For": "10.0.0.1"}) as r:
        assert r.status == 403


async def test_get_needs_a_valid_token(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    assert (await _get(http, emu, SPOT, None))[0] == 401
    assert (await _get(http, emu, SPOT, "not-a-token"))[0] == 401
    token = await aws_token()
    status, _, _ = await _get(http, emu, SPOT, token)
    assert status == 404  # no notice yet, but authorised


async def test_token_expires_then_401(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    emu.configure(aws_token_max_ttl=0.2)
    token = await aws_token(ttl=21600)
    assert (await _get(http, emu, SPOT, token))[0] == 404
    await asyncio.sleep(0.3)  # the behaviour under test is the passage of time
    assert (await _get(http, emu, SPOT, token))[0] == 401
    fresh = await aws_token()
    assert (await _get(http, emu, SPOT, fresh))[0] == 404


async def test_hanging_token_put_times_out_client_side(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.configure(aws_token_put_hang=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.put(
            f"{emu.url}/latest/api/token", headers={TTL: "60"}, timeout=aiohttp.ClientTimeout(total=0.3)
        ):
            pass
    assert emu.state.request_count("PUT", "/latest/api/token") == 1


async def test_imdsv1_serves_without_token(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.configure(aws_imdsv1=True)
    assert (await _get(http, emu, "/latest/meta-data/instance-id", None))[0] == 200
    assert (await _get(http, emu, SPOT, "bad-token"))[0] == 401  # a bad token still fails


async def test_imds_disabled_is_403(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.configure(aws_disabled=True)
    async with http.put(f"{emu.url}/latest/api/token", headers={TTL: "60"}) as r:
        assert r.status == 403


@pytest.mark.serial
async def test_spot_instance_action_and_legacy_termination_time(
    emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken
) -> None:
    token = await aws_token()
    assert (await _get(http, emu, "/latest/meta-data/spot/termination-time", token))[0] == 404
    before = utcnow()
    emu.notice("aws", "preemption", 120)
    status, ctype, body = await _get(http, emu, SPOT, token)
    assert status == 200 and ctype == "text/plain"  # real IMDS labels JSON text/plain
    doc = json.loads(body)
    assert doc["action"] == "terminate"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["time"])
    when = parse_rfc3339(doc["time"])
    assert before + timedelta(seconds=118) <= when <= before + timedelta(seconds=122)
    status, _, text = await _get(http, emu, "/latest/meta-data/spot/termination-time", token)
    assert status == 200 and text == doc["time"]
    # polled again: identical (stable) content
    assert (await _get(http, emu, SPOT, token))[2] == body


async def test_spot_stop_action_has_no_termination_time(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    emu.notice("aws", "preemption", 120, action="stop")
    assert json.loads((await _get(http, emu, SPOT, token))[2])["action"] == "stop"
    assert (await _get(http, emu, "/latest/meta-data/spot/termination-time", token))[0] == 404


@pytest.mark.serial
async def test_recompute_time_moves_with_the_clock_in_whole_seconds(emu: Emulator, http: aiohttp.ClientSession,
                                                                     aws_token: GetToken) -> None:
    """Like amazon-ec2-metadata-mock: ``time`` = now + the notice's length, whole seconds, on every request."""
    token = await aws_token()
    emu.configure(aws_recompute_time=True)
    emu.notice("aws", "preemption", 120)
    texts, asked = [], []
    for _ in range(2):
        asked.append(utcnow())
        texts.append(json.loads((await _get(http, emu, SPOT, token))[2])["time"])
        await asyncio.sleep(1.1)  # the clock must move on by a whole second (what is tested)
    first, second = (parse_rfc3339(t) for t in texts)
    assert all(t.endswith("Z") and "." not in t for t in texts), texts  # whole seconds
    assert -1.5 < (first - asked[0]).total_seconds() - 120 < 1.5
    assert second - first >= timedelta(seconds=1), texts  # recomputed: it moved on


async def test_rebalance_recommendation_comes_before_the_spot_notice(emu: Emulator, http: aiohttp.ClientSession,
                                                                     aws_token: GetToken) -> None:
    token = await aws_token()
    emu.configure(aws_rebalance_lead=1.0)
    rec = emu.notice("aws", "preemption", 120)
    assert (await _get(http, emu, "/latest/meta-data/events/recommendations/rebalance", token))[0] == 200
    assert (await _get(http, emu, SPOT, token))[0] == 404  # not yet
    await asyncio.sleep(1.1)
    status, _, body = await _get(http, emu, SPOT, token)
    assert status == 200 and json.loads(body)["action"] == "terminate"
    assert abs((parse_rfc3339(json.loads(body)["time"]) - rec.deadline).total_seconds()) < 1.0


async def test_rebalance_recommendation(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    path = "/latest/meta-data/events/recommendations/rebalance"
    assert (await _get(http, emu, path, token))[0] == 404
    emu.notice("aws", "rebalance")
    status, _, body = await _get(http, emu, path, token)
    assert status == 200
    assert abs((parse_rfc3339(json.loads(body)["noticeTime"]) - utcnow()).total_seconds()) < 5


async def test_scheduled_events_dates_and_states(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    path = "/latest/meta-data/events/maintenance/scheduled"
    status, _, body = await _get(http, emu, path, token)
    assert status == 200 and json.loads(body) == []
    a = emu.notice("aws", "maintenance", 600, code="instance-stop")
    b = emu.notice("aws", "maintenance", 900)
    events = {e["EventId"]: e for e in json.loads((await _get(http, emu, path, token))[2])}
    assert set(events) == {a.id, b.id}
    assert re.fullmatch(r"instance-event-[0-9a-f]{17}", a.id)
    ea = events[a.id]
    assert ea["Code"] == "instance-stop" and ea["State"] == "active"
    assert events[b.id]["Code"] == "system-maintenance"
    for key in ("NotBefore", "NotAfter", "NotBeforeDeadline"):
        assert re.fullmatch(r"\d{1,2} [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", ea[key]), ea[key]
    assert abs((parse_rfc1123(ea["NotBefore"]) - a.deadline).total_seconds()) < 1
    emu.cancel("aws", a.id)
    emu.cancel("aws", b.id, state="completed")
    events = {e["EventId"]: e for e in json.loads((await _get(http, emu, path, token))[2])}
    assert events[a.id]["State"] == "canceled"
    assert events[b.id]["State"] == "completed"


async def test_asg_lifecycle(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    path = "/latest/meta-data/autoscaling/target-lifecycle-state"
    assert (await _get(http, emu, path, token))[0] == 404
    emu.configure(asg=True)
    assert (await _get(http, emu, path, token))[2] == "InService"
    emu.notice("aws", "termination")
    assert (await _get(http, emu, path, token))[2] == "Terminated"
    emu.cancel("aws")
    assert (await _get(http, emu, path, token))[2] == "InService"


async def test_identity_document(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    status, _, body = await _get(http, emu, "/latest/dynamic/instance-identity/document", token)
    assert status == 200
    doc = json.loads(body)
    assert doc["instanceId"].startswith("i-") and doc["region"] and doc["instanceType"]


async def test_unknown_path_is_404_after_auth(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    assert (await _get(http, emu, "/latest/meta-data/nope", token))[0] == 404
    assert (await _get(http, emu, "/latest/meta-data/nope", None))[0] == 401
