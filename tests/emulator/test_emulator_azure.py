"""Azure Scheduled Events emulation: header/api-version errors, incarnation, approval, throttling."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp
import pytest

from spotguard.emulator.server import Emulator
from spotguard.timefmt import parse_rfc1123

AZ = {"Metadata": "true"}
SE = "/metadata/scheduledevents"
V = "2020-07-01"


async def _get(
    http: aiohttp.ClientSession, emu: Emulator, query: str = f"api-version={V}", headers: dict[str, str] = AZ
) -> tuple[int, str, Any]:
    async with http.get(f"{emu.url}{SE}?{query}", headers=headers) as r:
        text = await r.text()
        return r.status, r.content_type, json.loads(text) if text else None


async def _doc(http: aiohttp.ClientSession, emu: Emulator, version: str = V) -> dict[str, Any]:
    status, ctype, doc = await _get(http, emu, f"api-version={version}")
    assert (status, ctype) == (200, "application/json")
    assert isinstance(doc, dict)
    return doc


@pytest.fixture
def unthrottled(emu: Emulator) -> Emulator:
    """Most tests make more than 5 calls in a second; throttling has its own test."""
    emu.configure(azure_rate_limit=0)
    return emu


async def test_header_required(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    status, ctype, body = await _get(http, unthrottled, headers={})
    assert (status, ctype) == (400, "application/json")
    assert "metadata header" in body["error"].lower()
    assert (await _get(http, unthrottled, headers={"Metadata": "false"}))[0] == 400


@pytest.mark.parametrize("query", ["", "api-version=", "api-version=2099-01-01", "api-version=2021-02-01"])
async def test_api_version_required_and_known(unthrottled: Emulator, http: aiohttp.ClientSession, query: str) -> None:
    status, _, body = await _get(http, unthrottled, query)
    assert status == 400
    assert "api-version" in body["error"] and body["newest-versions"]


@pytest.mark.parametrize("version", ["2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01"])
async def test_known_versions_accepted(unthrottled: Emulator, http: aiohttp.ClientSession, version: str) -> None:
    doc = await _doc(http, unthrottled, version)
    assert doc["Events"] == [] and isinstance(doc["DocumentIncarnation"], int)


async def test_event_shape_and_incarnation(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    emu = unthrottled
    inc0 = (await _doc(http, emu))["DocumentIncarnation"]
    assert (await _doc(http, emu))["DocumentIncarnation"] == inc0  # unchanged document, same incarnation
    rec = emu.notice("azure", "preemption", 30)
    doc = await _doc(http, emu)
    assert doc["DocumentIncarnation"] == inc0 + 1
    (ev,) = doc["Events"]
    assert ev["EventId"] == rec.id
    assert ev["EventType"] == "Preempt" and ev["ResourceType"] == "VirtualMachine"
    assert ev["Resources"] == ["vm-0"] and ev["EventStatus"] == "Scheduled"
    assert ev["EventSource"] == "Platform" and ev["DurationInSeconds"] == -1
    assert ev["NotBefore"].endswith(" GMT") and "," in ev["NotBefore"]  # RFC 1123
    assert abs((parse_rfc1123(ev["NotBefore"]) - rec.deadline).total_seconds()) < 1
    emu.notice("azure", "termination")
    emu.notice("azure", "maintenance")
    doc = await _doc(http, emu)
    assert doc["DocumentIncarnation"] == inc0 + 3
    assert [e["EventType"] for e in doc["Events"]] == ["Preempt", "Terminate", "Freeze"]
    # pre-2020-07-01 documents have no EventSource/DurationInSeconds
    assert "EventSource" not in (await _doc(http, emu, "2019-08-01"))["Events"][0]


async def test_events_for_other_vms(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    emu = unthrottled
    other = emu.notice("azure", "preemption", 30, resources=["vm-1", "vm-2"])
    mine = emu.notice("azure", "maintenance", 900, event_type="Reboot")
    events = {e["EventId"]: e for e in (await _doc(http, emu))["Events"]}
    assert events[other.id]["Resources"] == ["vm-1", "vm-2"]
    assert events[mine.id]["Resources"] == ["vm-0"] and events[mine.id]["EventType"] == "Reboot"


async def test_start_requests_approval(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    emu = unthrottled
    rec = emu.notice("azure", "preemption", 30)
    inc = (await _doc(http, emu))["DocumentIncarnation"]
    body = {"StartRequests": [{"EventId": rec.id}]}
    async with http.post(f"{emu.url}{SE}?api-version={V}", json=body, headers=AZ) as r:
        assert r.status == 200
    doc = await _doc(http, emu)
    (ev,) = doc["Events"]
    assert ev["EventStatus"] == "Started" and ev["NotBefore"] == ""
    assert doc["DocumentIncarnation"] == inc + 1
    assert emu.state.azure_approved == [rec.id]
    async with http.get(f"{emu.url}/_emulator/state") as r:
        assert (await r.json())["azure"]["approved"] == [rec.id]


@pytest.mark.parametrize("body", [b"not json", b"{}", b'{"StartRequests": "x"}', b'{"StartRequests": [{}]}'])
async def test_start_requests_bad_body(unthrottled: Emulator, http: aiohttp.ClientSession, body: bytes) -> None:
    async with http.post(f"{unthrottled.url}{SE}?api-version={V}", data=body, headers=AZ) as r:
        assert r.status == 400


async def test_start_requests_needs_header_and_version(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    rec = unthrottled.notice("azure", "preemption")
    body = {"StartRequests": [{"EventId": rec.id}]}
    async with http.post(f"{unthrottled.url}{SE}?api-version={V}", json=body) as r:
        assert r.status == 400
    async with http.post(f"{unthrottled.url}{SE}", json=body, headers=AZ) as r:
        assert r.status == 400
    assert unthrottled.state.azure_approved == []


async def test_event_starts_by_itself_at_not_before(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    unthrottled.notice("azure", "preemption", 0)
    (ev,) = (await _doc(http, unthrottled))["Events"]
    assert ev["EventStatus"] == "Started" and ev["NotBefore"] == ""


async def test_cancel_removes_event_and_bumps(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    rec = unthrottled.notice("azure", "termination")
    inc = (await _doc(http, unthrottled))["DocumentIncarnation"]
    unthrottled.cancel("azure", rec.id)
    doc = await _doc(http, unthrottled)
    assert doc["Events"] == [] and doc["DocumentIncarnation"] == inc + 1


async def test_compute_name(unthrottled: Emulator, http: aiohttp.ClientSession) -> None:
    url = f"{unthrottled.url}/metadata/instance/compute?api-version=2021-02-01"
    async with http.get(url, headers=AZ) as r:
        assert r.status == 200 and (await r.json())["name"] == "vm-0"
    unthrottled.configure(azure_vm_name="trainer-7")
    async with http.get(url, headers=AZ) as r:
        assert (await r.json())["name"] == "trainer-7"
    async with http.get(url) as r:
        assert r.status == 400
    async with http.get(f"{unthrottled.url}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                        headers=AZ) as r:  # fmt: skip
        assert await r.text() == "trainer-7"
    async with http.get(f"{unthrottled.url}/metadata/instance/compute/name?api-version=2021-02-01", headers=AZ) as r:
        assert r.status == 400  # leaves need format=text


async def test_throttled_beyond_5_per_second(emu: Emulator, http: aiohttp.ClientSession) -> None:
    results = await asyncio.gather(*(_get(http, emu) for _ in range(8)))
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) == 5 and statuses.count(429) == 3
    assert emu.state.request_count("GET", SE) == 8
    await asyncio.sleep(1.05)  # the behaviour under test is the 1 s window
    assert (await _get(http, emu))[0] == 200


async def test_five_requests_in_a_second_are_allowed(emu: Emulator, http: aiohttp.ClientSession) -> None:
    statuses: list[Optional[int]] = []
    for _ in range(5):
        statuses.append((await _get(http, emu))[0])
    assert statuses == [200] * 5
