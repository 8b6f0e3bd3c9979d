"""AzureWatcher against the real emulator: events for this VM only, rate guard, approval, faults."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
from structlog.testing import capture_logs

from spotguard.daemon.watchers.azure import PATH_COMPUTE, PATH_EVENTS, AzureWatcher
from spotguard.emulator.server import Emulator
from spotguard.timefmt import utcnow

from .conftest import refused_then_server_appears

FAST = dict(poll_interval=0.05, request_timeout=0.3, backoff_cap=0.3)


def watcher(url: str, **kw: Any) -> AzureWatcher:
    return AzureWatcher(url, **{**FAST, **kw})


def azure_requests(emu: Emulator) -> int:
    return sum(n for key, n in emu.state.requests.items() if key.split(" ", 1)[1].startswith("/metadata/"))


async def polls(emu: Emulator, n: int) -> None:
    """Wait for ``n`` more scheduled-events GETs."""
    await emu.state.wait_requests("GET", PATH_EVENTS, emu.state.request_count("GET", PATH_EVENTS) + n, timeout=8)


async def test_preempt_for_this_vm_is_a_preemption(emu: Emulator, collect: Callable) -> None:
    w = watcher(emu.url)
    c = collect(w)
    rec = emu.notice("azure", "preemption", 45)
    n = await c.next_notice()
    assert (n.source, n.kind) == ("azure", "preemption")
    assert abs((n.deadline - rec.deadline).total_seconds()) < 1.0  # RFC 1123: second precision
    assert rec.id in n.detail
    assert w.node == "vm-0"
    emu.notice("azure", "termination", 600)
    assert (await c.next_notice()).kind == "termination"
    emu.notice("azure", "maintenance", 900, event_type="Redeploy")
    assert (await c.next_notice()).kind == "maintenance"


async def test_event_for_another_vm_is_not_delivered(emu: Emulator, collect: Callable) -> None:
    c = collect(watcher(emu.url))
    emu.notice("azure", "preemption", 60, resources=["vm-7", "vm-8"])
    await polls(emu, 2)
    c.assert_empty()
    mine = emu.notice("azure", "preemption", 60, resources=["vm-7", "VM-0"])  # names compare case-insensitively
    n = await c.next_notice()
    assert mine.id in n.detail
    await polls(emu, 2)
    c.assert_empty()


async def test_cancelled_event_yields_cancel(emu: Emulator, collect: Callable) -> None:
    c = collect(watcher(emu.url))
    rec = emu.notice("azure", "maintenance", 900)
    n = await c.next_notice()
    emu.cancel("azure", rec.id)
    cancel = await c.next_cancel()
    assert cancel.id == n.id and cancel.source == "azure"


async def test_same_event_polled_100_times_is_yielded_once(emu: Emulator, collect: Callable) -> None:
    emu.configure(azure_rate_limit=0)  # lets the test poll fast; real IMDS never would
    c = collect(watcher(emu.url, poll_interval=0.001, min_request_spacing=0.0))
    emu.notice("azure", "preemption", 60)
    n = await c.next_notice()
    await polls(emu, 100)
    c.assert_empty()
    assert [e.id for e in c.seen] == [n.id]


async def test_never_more_than_5_requests_per_second(emu: Emulator, collect: Callable, wait_until: Any) -> None:
    # Poll "as fast as possible" through an error storm (retries included), with the
    # VM name unknown (so every cycle also asks for it): the pacer must still hold.
    w = watcher(emu.url, poll_interval=0.001, backoff_cap=0.001)
    emu.fault("status", cloud="azure", status=500)
    collect(w)
    t0 = time.monotonic()
    start = azure_requests(emu)
    await asyncio.sleep(2.0)  # measuring a rate over a window
    made = azure_requests(emu) - start
    elapsed = time.monotonic() - t0
    assert made <= 5 * elapsed + 1, (made, elapsed)
    assert made >= 4, made  # and it did keep trying
    emu.state.clear_faults()
    await wait_until(lambda: w.health.healthy, what="recovery")
    # The emulator enforces the 5/s window itself: it never had to throttle us.
    assert "http_429" not in w.health.errors_by_reason
    assert not [e for e in emu.state.request_log if e["status"] == 429]


async def test_429_backs_off_with_retry_after_and_recovers(emu: Emulator, collect: Callable, wait_until: Any) -> None:
    w = watcher(emu.url)
    c = collect(w)
    await polls(emu, 1)
    emu.fault("status", cloud="azure", path=PATH_EVENTS, status=429, retry_after=1, count=1)
    t0 = time.monotonic()
    await wait_until(lambda: w.health.errors_by_reason.get("http_429", 0) == 1, what="the 429")
    before = emu.state.request_count("GET", PATH_EVENTS)
    await polls(emu, 1)
    assert time.monotonic() - t0 >= 0.9  # Retry-After: 1 honoured
    assert emu.state.request_count("GET", PATH_EVENTS) == before + 1
    emu.notice("azure", "preemption", 60)
    assert (await c.next_notice()).kind == "preemption"
    assert w.health.healthy


async def test_events_pending_until_vm_name_is_known(emu: Emulator, collect: Callable, wait_until: Any) -> None:
    emu.fault("status", cloud="azure", path=PATH_COMPUTE, status=500)
    emu.notice("azure", "preemption", 60)
    with capture_logs() as logs:
        w = watcher(emu.url)
        c = collect(w)
        await wait_until(lambda: w.health.errors_by_reason.get("http_500", 0) >= 2, what="compute errors")
        await polls(emu, 1)
        c.assert_empty()
        assert w.node is None
        pending = [e for e in logs if e["event"] == "azure_events_pending"]
        assert len(pending) == 1 and pending[0]["pending"] == 1  # logged once, not per poll
        emu.state.clear_faults()
        n = await c.next_notice()
    assert n.kind == "preemption" and w.node == "vm-0"


@pytest.mark.serial
async def test_started_event_gets_the_minimum_notice_deadline(emu: Emulator, collect: Callable) -> None:
    emu.notice("azure", "preemption", 0)  # NotBefore already passed: the event is Started, NotBefore ""
    c = collect(watcher(emu.url))
    n = await c.next_notice()
    assert '"NotBefore": ""' in n.detail and '"EventStatus": "Started"' in n.detail
    assert timedelta(seconds=28) < n.deadline - utcnow() <= timedelta(seconds=30)


async def test_approve_posts_start_requests_once(emu: Emulator, collect: Callable) -> None:
    w = watcher(emu.url)
    c = collect(w)
    rec = emu.notice("azure", "preemption", 60)
    n = await c.next_notice()
    assert await w.approve(n) is True
    assert emu.state.azure_approved == [rec.id]
    await polls(emu, 2)  # the event is now Started (new incarnation): not a new notice
    c.assert_empty()


async def test_approve_unknown_notice_is_a_no_op(emu: Emulator, collect: Callable) -> None:
    from spotguard.notice import Notice

    w = watcher(emu.url)
    collect(w)
    assert await w.approve(Notice(id="azure-nope", source="azure", kind="preemption", deadline=utcnow())) is False
    assert emu.state.azure_approved == [] and emu.state.request_count("POST", PATH_EVENTS) == 0


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("status", "http_500"),
        ("status", "http_503"),
        ("malformed", "bad_json"),
        ("content_type", "content_type"),
        ("hang", "timeout"),
        ("reset", "connection_reset"),
    ],
)
async def test_bad_responses_are_reported_and_recovered(
    emu: Emulator, collect: Callable, wait_until: Any, mode: str, reason: str
) -> None:
    w = watcher(emu.url)
    c = collect(w)
    await polls(emu, 1)
    status = int(reason[5:]) if mode == "status" else 503
    emu.fault(mode, cloud="azure", path=PATH_EVENTS, status=status)
    emu.notice("azure", "preemption", 60)
    with capture_logs() as logs:
        await wait_until(lambda: w.health.errors_by_reason.get(reason, 0) >= 2, what=f"{reason} errors")
    assert any(e["event"] == "azure_poll_error" and e["reason"] == reason for e in logs)
    c.assert_empty()
    emu.state.clear_faults()
    assert (await c.next_notice(timeout=3)).kind == "preemption"
    await wait_until(lambda: w.health.healthy, what="recovery")


async def test_connection_refused_then_server_appears(closed_port_url: str, collect: Callable) -> None:
    await refused_then_server_appears(collect, watcher(closed_port_url), closed_port_url, "azure", "preemption", 60)


def test_defaults() -> None:
    w = AzureWatcher()
    assert (w.base_url, w.poll_interval, w.api_version) == ("http://169.254.169.254", 1.0, "2020-07-01")
