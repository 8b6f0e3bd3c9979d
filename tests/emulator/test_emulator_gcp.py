"""GCP metadata emulation: header check, ETags and true hanging GETs."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from spotguard.emulator.server import Emulator

GCP = {"Metadata-Flavor": "Google"}
PREEMPTED = "/computeMetadata/v1/instance/preempted"
MAINT = "/computeMetadata/v1/instance/maintenance-event"


async def _get(http: aiohttp.ClientSession, url: str, headers: dict[str, str] = GCP) -> tuple[int, str, str, str]:
    async with http.get(url, headers=headers) as r:
        return r.status, r.headers.get("ETag", ""), r.content_type, await r.text()


async def test_header_required(emu: Emulator, http: aiohttp.ClientSession) -> None:
    assert (await _get(http, emu.url + PREEMPTED, {}))[0] == 403
    assert (await _get(http, emu.url + PREEMPTED, {"Metadata-Flavor": "google-ish"}))[0] == 403
    assert (await _get(http, emu.url + PREEMPTED, {**GCP, "X-Forwarded-For": "1.2.3.4"}))[0] == 403


async def test_plain_values_have_etag_and_text_plain(emu: Emulator, http: aiohttp.ClientSession) -> None:
    status, etag, ctype, body = await _get(http, emu.url + PREEMPTED)
    assert (status, ctype, body) == (200, "text/plain", "FALSE")
    assert len(etag) == 16
    assert (await _get(http, emu.url + MAINT))[3] == "NONE"
    for leaf in ("name", "hostname", "id", "zone"):
        status, etag, _, body = await _get(http, f"{emu.url}/computeMetadata/v1/instance/{leaf}")
        assert status == 200 and etag and body


async def test_kinds_map_to_values(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.notice("gcp", "maintenance")
    assert (await _get(http, emu.url + MAINT))[3] == "MIGRATE_ON_HOST_MAINTENANCE"
    emu.cancel("gcp")
    emu.notice("gcp", "termination")
    assert (await _get(http, emu.url + MAINT))[3] == "TERMINATE_ON_HOST_MAINTENANCE"
    emu.notice("gcp", "preemption")
    assert (await _get(http, emu.url + PREEMPTED))[3] == "TRUE"
    emu.cancel("gcp")
    assert (await _get(http, emu.url + PREEMPTED))[3] == "FALSE"
    assert (await _get(http, emu.url + MAINT))[3] == "NONE"


@pytest.mark.serial
async def test_wait_for_change_blocks_until_notice(emu: Emulator, http: aiohttp.ClientSession) -> None:
    _, etag0, _, _ = await _get(http, emu.url + PREEMPTED)
    task = asyncio.create_task(_get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true"))
    await emu.state.wait_requests("GET", PREEMPTED, 2)
    # the hanging GET is parked on the server; nothing else is going to happen
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done
    async with http.post(f"{emu.url}/_emulator/notice", json={"cloud": "gcp", "kind": "preemption"}) as r:
        assert r.status == 200
    t0 = time.monotonic()
    status, etag1, _, body = await asyncio.wait_for(task, 2)
    assert time.monotonic() - t0 < 0.5
    assert (status, body) == (200, "TRUE")
    assert etag1 and etag1 != etag0
    assert emu.state.request_count("GET", PREEMPTED) == 2  # one plain GET, one hanging GET


async def test_wait_for_change_wakes_on_cancel_too(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.notice("gcp", "termination")
    task = asyncio.create_task(_get(http, f"{emu.url}{MAINT}?wait_for_change=true"))
    await emu.state.wait_requests("GET", MAINT, 1)
    emu.cancel("gcp")
    assert (await asyncio.wait_for(task, 2))[3] == "NONE"


async def test_unrelated_change_does_not_wake_waiter(emu: Emulator, http: aiohttp.ClientSession) -> None:
    task = asyncio.create_task(_get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true"))
    await emu.state.wait_requests("GET", PREEMPTED, 1)
    emu.notice("gcp", "maintenance")  # changes maintenance-event, not preempted
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done
    emu.notice("gcp", "preemption")
    assert (await asyncio.wait_for(task, 2))[3] == "TRUE"


async def test_last_etag_differs_returns_at_once(emu: Emulator, http: aiohttp.ClientSession) -> None:
    _, etag, _, _ = await _get(http, emu.url + PREEMPTED)
    status, etag2, _, body = await asyncio.wait_for(
        _get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true&last_etag=0"), 1
    )
    assert (status, body, etag2) == (200, "FALSE", etag)
    # an old etag from before a change: also at once, with the new value
    emu.notice("gcp", "preemption")
    status, _, _, body = await asyncio.wait_for(
        _get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}"), 1
    )
    assert body == "TRUE"


@pytest.mark.serial
async def test_timeout_sec_returns_current_value(emu: Emulator, http: aiohttp.ClientSession) -> None:
    _, etag, _, _ = await _get(http, emu.url + PREEMPTED)
    t0 = time.monotonic()
    status, etag2, _, body = await _get(
        http, f"{emu.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}&timeout_sec=1"
    )
    elapsed = time.monotonic() - t0
    assert (status, body, etag2) == (200, "FALSE", etag)
    assert 0.9 <= elapsed < 3


async def test_ignore_wait_answers_at_once(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.configure(gcp_ignore_wait=True)
    _, etag, _, _ = await _get(http, emu.url + PREEMPTED)
    status, _, _, body = await asyncio.wait_for(
        _get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}"), 1
    )
    assert (status, body) == (200, "FALSE")


async def test_recursive_directory_is_json(emu: Emulator, http: aiohttp.ClientSession) -> None:
    status, etag, ctype, body = await _get(http, f"{emu.url}/computeMetadata/v1/instance/?recursive=true")
    assert status == 200 and ctype == "application/json" and etag
    doc = json.loads(body)
    assert doc["preempted"] == "FALSE" and doc["maintenanceEvent"] == "NONE"
    status, _, _, listing = await _get(http, f"{emu.url}/computeMetadata/v1/instance/")
    assert "preempted\n" in listing and "scheduling/\n" in listing


@pytest.mark.parametrize(
    "query", ["wait_for_change=maybe", "wait_for_change=true&timeout_sec=abc", "wait_for_change=true&timeout_sec=0"]
)
async def test_bad_query_is_400(emu: Emulator, http: aiohttp.ClientSession, query: str) -> None:
    assert (await _get(http, f"{emu.url}{PREEMPTED}?{query}"))[0] == 400


async def test_unknown_path_is_404(emu: Emulator, http: aiohttp.ClientSession) -> None:
    assert (await _get(http, f"{emu.url}/computeMetadata/v1/instance/nope"))[0] == 404


@pytest.mark.serial
async def test_shutdown_releases_hanging_get(http: aiohttp.ClientSession) -> None:
    from spotguard.emulator.server import running_emulator

    async with running_emulator() as emu:
        task = asyncio.create_task(_get(http, f"{emu.url}{PREEMPTED}?wait_for_change=true"))
        await emu.state.wait_requests("GET", PREEMPTED, 1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.5
    status = (await asyncio.wait_for(task, 2))[0]
    assert status == 200


async def test_upcoming_maintenance_window_while_maintenance_is_announced(emu: Emulator,
                                                                         http: aiohttp.ClientSession) -> None:
    upcoming = emu.url + "/computeMetadata/v1/instance/upcoming-maintenance"
    assert (await _get(http, upcoming))[0] == 404  # nothing announced
    rec = emu.notice("gcp", "termination", 3600)  # a GPU VM: told about an hour ahead
    status, etag, _, body = await _get(http, upcoming)
    doc = json.loads(body)
    assert status == 200 and etag
    assert doc["maintenanceType"] == "SCHEDULED" and doc["canReschedule"] is False
    assert doc["windowStartTime"] == rec.deadline.strftime("%Y-%m-%dT%H:%M:%SZ") == doc["latestWindowStartTime"]
    assert doc["windowEndTime"] > doc["windowStartTime"]
    emu.cancel("gcp")
    assert (await _get(http, upcoming))[0] == 404
