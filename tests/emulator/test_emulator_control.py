"""Control API and fault injection: every mode, scoping, counting, reset, validation."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

import aiohttp
import pytest

from spotguard.emulator.server import Emulator

GetToken = Callable[..., Awaitable[str]]

GCP = {"Metadata-Flavor": "Google"}
AZ = {"Metadata": "true"}
PREEMPTED = "/computeMetadata/v1/instance/preempted"
SE = "/metadata/scheduledevents?api-version=2020-07-01"


async def _ctl(http: aiohttp.ClientSession, emu: Emulator, path: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(f"{emu.url}/_emulator/{path}", json=body) as r:
        return r.status, await r.json()


async def _state(http: aiohttp.ClientSession, emu: Emulator) -> dict[str, Any]:
    async with http.get(f"{emu.url}/_emulator/state") as r:
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def _gcp(http: aiohttp.ClientSession, emu: Emulator, **kw: Any) -> aiohttp.ClientResponse:
    async with http.get(emu.url + PREEMPTED, headers=GCP, **kw) as r:
        await r.read()
        return r


async def test_status_fault_with_count(emu: Emulator, http: aiohttp.ClientSession) -> None:
    status, body = await _ctl(http, emu, "fault", {"cloud": "gcp", "mode": "status", "status": 503, "count": 2})
    assert status == 200 and body["id"]
    assert [(await _gcp(http, emu)).status for _ in range(3)] == [503, 503, 200]
    assert (await _state(http, emu))["faults"] == []  # exhausted faults go away


async def test_429_fault_has_retry_after(emu: Emulator, http: aiohttp.ClientSession) -> None:
    await _ctl(http, emu, "fault", {"cloud": "azure", "mode": "status", "status": 429})
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "1"
    await _ctl(http, emu, "fault/clear")
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 200


async def test_fault_before_auth(emu: Emulator, http: aiohttp.ClientSession) -> None:
    """A broken IMDS fails before it looks at the token."""
    emu.fault("status", cloud="aws", status=500, count=1)
    async with http.get(f"{emu.url}/latest/meta-data/spot/instance-action") as r:
        assert r.status == 500
    async with http.get(f"{emu.url}/latest/meta-data/spot/instance-action") as r:
        assert r.status == 401


async def test_fault_scoped_by_cloud_and_path(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.fault("status", cloud="gcp", path="/computeMetadata/v1/instance/maintenance-event", status=503)
    assert (await _gcp(http, emu)).status == 200
    async with http.get(f"{emu.url}/computeMetadata/v1/instance/maintenance-event", headers=GCP) as r:
        assert r.status == 503
    emu.state.clear_faults()
    emu.fault("status", cloud="aws", status=503)
    assert (await _gcp(http, emu)).status == 200


async def test_star_fault_hits_every_cloud(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.fault("status", cloud="*", status=502)
    assert (await _gcp(http, emu)).status == 502
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 502
    async with http.put(f"{emu.url}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "5"}) as r:
        assert r.status == 502
    async with http.get(f"{emu.url}/_emulator/state") as r:  # the control API is never faulted
        assert r.status == 200


async def test_hang_fault_client_timeout_fires(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.fault("hang", cloud="gcp", count=1)
    with pytest.raises(asyncio.TimeoutError):
        await _gcp(http, emu, timeout=aiohttp.ClientTimeout(total=0.3))
    assert (await _gcp(http, emu)).status == 200  # count consumed: next one is served


async def test_slow_fault(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.fault("slow", cloud="gcp", delay=0.3, count=1)
    t0 = time.monotonic()
    r = await _gcp(http, emu)
    assert r.status == 200 and time.monotonic() - t0 >= 0.3


async def test_malformed_fault(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    emu.notice("aws", "preemption")
    emu.fault("malformed", cloud="aws", count=1)
    async with http.get(
        f"{emu.url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    ) as r:
        assert r.status == 200
        with pytest.raises(ValueError):
            json.loads(await r.text())
    emu.fault("malformed", cloud="azure", count=1)
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 200 and r.content_type == "application/json"
        with pytest.raises(ValueError):
            json.loads(await r.text())
    emu.fault("malformed", cloud="gcp", count=1)
    async with http.get(emu.url + PREEMPTED, headers=GCP) as r:
        assert r.status == 200 and (await r.read()) not in (b"TRUE", b"FALSE")


async def test_content_type_fault(emu: Emulator, http: aiohttp.ClientSession) -> None:
    emu.fault("content_type", cloud="azure", count=1)
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 200 and r.content_type == "text/html"
        assert json.loads(await r.text())["Events"] == []


async def test_reset_fault_drops_connection(emu: Emulator, http: aiohttp.ClientSession) -> None:
    # aiohttp's client silently retries an idempotent request once after a reset,
    # so it takes two resets for the caller to see the error.
    emu.fault("reset", cloud="gcp", count=2)
    with pytest.raises(aiohttp.ClientConnectionError):
        await _gcp(http, emu)
    assert emu.state.request_count("GET", PREEMPTED) == 2
    assert (await _gcp(http, emu)).status == 200


async def test_request_counters_and_log(emu: Emulator, http: aiohttp.ClientSession) -> None:
    for _ in range(3):
        await _gcp(http, emu)
    async with http.get(emu.url + SE, headers=AZ) as r:
        assert r.status == 200
    state = await _state(http, emu)
    assert state["requests"] == {f"GET {PREEMPTED}": 3, "GET /metadata/scheduledevents": 1}
    last = state["request_log_tail"][-1]
    assert last["path"] == "/metadata/scheduledevents" and last["status"] == 200


async def test_notice_and_cancel_over_http(emu: Emulator, http: aiohttp.ClientSession) -> None:
    status, rec = await _ctl(http, emu, "notice", {"cloud": "gcp", "kind": "preemption", "in_seconds": 30})
    assert status == 200 and rec["id"] and rec["deadline"].endswith("Z")
    assert (await _state(http, emu))["gcp"]["preempted"] == "TRUE"
    status, body = await _ctl(http, emu, "cancel", {"id": rec["id"]})
    assert status == 200 and body["cancelled"] == [rec["id"]]
    assert (await _state(http, emu))["gcp"]["preempted"] == "FALSE"


@pytest.mark.parametrize(
    "path,body",
    [
        ("notice", {"cloud": "ibm", "kind": "preemption"}),
        ("notice", {"cloud": "aws", "kind": "eviction"}),
        ("notice", {"cloud": "gcp", "kind": "rebalance"}),
        ("notice", {"cloud": "aws", "kind": "preemption", "in_seconds": "soon"}),
        ("notice", {"cloud": "aws", "kind": "preemption", "bogus": 1}),
        ("notice", {"cloud": "azure", "kind": "preemption", "event_type": "Explode"}),
        ("cancel", {}),
        ("cancel", {"id": "no-such-notice"}),
        ("fault", {"mode": "explode"}),
        ("fault", {"mode": "status", "cloud": "oracle"}),
        ("fault", {"mode": "status", "status": 99}),
        ("fault", {"mode": "status", "count": 0}),
        ("config", {"no_such_switch": True}),
        ("config", {"gcp_ignore_wait": "yes"}),
        ("config", [1, 2]),
    ],
)
async def test_control_validation(emu: Emulator, http: aiohttp.ClientSession, path: str, body: Any) -> None:
    status, reply = await _ctl(http, emu, path, body)
    assert status == 400 and reply["error"]


async def test_control_bad_json(emu: Emulator, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{emu.url}/_emulator/notice", data=b"{nope") as r:
        assert r.status == 400


async def test_config_roundtrip(emu: Emulator, http: aiohttp.ClientSession) -> None:
    status, body = await _ctl(http, emu, "config", {"aws_imdsv1": True, "aws_token_max_ttl": 5})
    assert status == 200 and body["config"]["aws_imdsv1"] is True
    assert emu.state.config.aws_token_max_ttl == 5


async def test_reset_restores_everything(emu: Emulator, http: aiohttp.ClientSession, aws_token: GetToken) -> None:
    token = await aws_token()
    await _ctl(http, emu, "notice", {"cloud": "aws", "kind": "preemption"})
    await _ctl(http, emu, "fault", {"cloud": "gcp", "mode": "status"})
    await _ctl(http, emu, "config", {"asg": True})
    status, _ = await _ctl(http, emu, "reset")
    assert status == 200
    state = await _state(http, emu)
    assert state["notices"] == [] and state["faults"] == [] and state["requests"] == {}
    assert state["config"]["asg"] is False
    async with http.get(
        f"{emu.url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    ) as r:
        assert r.status == 401  # tokens revoked
    assert (await _gcp(http, emu)).status == 200


async def test_running_emulator_takes_config(http: aiohttp.ClientSession) -> None:
    from spotguard.emulator.server import running_emulator
    from spotguard.emulator.state import ControlError

    async with running_emulator(port=0, azure_vm_name="cfg-vm", asg=True) as emu:
        assert emu.port > 0 and emu.url == f"http://127.0.0.1:{emu.port}"
        assert emu.state.config.azure_vm_name == "cfg-vm" and emu.state.config.asg
        emu.configure(asg=False)
        emu.reset()
        assert emu.state.config.asg is True  # reset goes back to the start-up config
    with pytest.raises(ControlError):
        async with running_emulator(no_such_option=1):
            pass
