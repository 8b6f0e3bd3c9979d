"""AwsWatcher against the real emulator: notices, IMDSv2 session, hop limit, faults."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import pytest
from structlog.testing import capture_logs

from spotguard.daemon.watchers import aws as aws_mod
from spotguard.daemon.watchers.aws import HOP_LIMIT_FIX, PATH_SCHEDULED, PATH_SPOT, PATH_TOKEN, AwsWatcher
from spotguard.emulator.server import Emulator
from spotguard.timefmt import utcnow

from .conftest import refused_then_server_appears

FAST = dict(poll_interval=0.02, put_timeout=0.2, request_timeout=0.3, backoff_cap=0.3)


def watcher(url: str, **kw: Any) -> AwsWatcher:
    return AwsWatcher(url, **{**FAST, **kw})


async def test_spot_interruption_is_a_preemption_with_the_notice_deadline(emu: Emulator, collect: Callable,
                                                                         wait_until: Any) -> None:
    w = watcher(emu.url)
    c = collect(w)
    rec = emu.notice("aws", "preemption", 120)
    n = await c.next_notice()
    assert (n.source, n.kind) == ("aws", "preemption")
    # The emulator's spot time has second precision.
    assert abs((n.deadline - rec.deadline).total_seconds()) < 1.0
    assert '"action": "terminate"' in n.detail
    # The identity document is its own path (best effort, never in the notice's way).
    await wait_until(lambda: w.node == "i-0123456789abcdef0" and w.health.healthy, what="identity and health")


async def test_same_notice_polled_100_times_is_yielded_once_even_if_time_is_recomputed(
    emu: Emulator, collect: Callable
) -> None:
    emu.configure(aws_recompute_time=True)
    w = watcher(emu.url, poll_interval=0.002)
    c = collect(w)
    emu.notice("aws", "preemption", 120)
    first = await c.next_notice()
    start = emu.state.request_count("GET", PATH_SPOT)
    await emu.state.wait_requests("GET", PATH_SPOT, start + 100, timeout=10)
    c.assert_empty()
    assert [e.id for e in c.seen] == [first.id]
    # A later, different interruption is a new notice.
    emu.cancel("aws")
    await emu.state.wait_requests("GET", PATH_SPOT, emu.state.request_count("GET", PATH_SPOT) + 2)
    emu.notice("aws", "preemption", 60, action="stop")
    second = await c.next_notice()
    assert second.id != first.id and '"stop"' in second.detail


async def test_identical_spot_notice_after_a_gap_is_a_new_occurrence(emu: Emulator, collect: Callable) -> None:
    # The emulator's spot `time` has second precision: two trials within one second
    # show the same content, yet the daemon must deliver the second one too.
    c = collect(watcher(emu.url))
    emu.notice("aws", "preemption", 120)
    first = await c.next_notice()
    emu.cancel("aws")
    await emu.state.wait_requests("GET", PATH_SPOT, emu.state.request_count("GET", PATH_SPOT) + 2)
    emu.notice("aws", "preemption", 120)
    second = await c.next_notice()
    assert second.id != first.id


async def test_rebalance_and_asg_terminated(emu: Emulator, collect: Callable) -> None:
    emu.configure(asg=True)
    c = collect(watcher(emu.url))
    emu.notice("aws", "rebalance")
    n = await c.next_notice()
    assert n.kind == "rebalance" and n.deadline > utcnow() + timedelta(seconds=100)
    emu.notice("aws", "termination")
    n = await c.next_notice()
    assert n.kind == "termination" and n.detail == "target-lifecycle-state=Terminated"


async def test_scheduled_event_maintenance_then_cancel(emu: Emulator, collect: Callable) -> None:
    c = collect(watcher(emu.url))
    rec = emu.notice("aws", "maintenance", 3600, code="system-reboot")
    n = await c.next_notice()
    assert n.kind == "maintenance"
    assert abs((n.deadline - rec.deadline).total_seconds()) < 1.0
    assert rec.id in n.detail
    emu.cancel("aws", rec.id)
    cancel = await c.next_cancel()
    assert cancel.id == n.id and cancel.source == "aws"
    # The canceled event stays listed: no second cancel, no resurrection.
    await emu.state.wait_requests("GET", PATH_SCHEDULED, emu.state.request_count("GET", PATH_SCHEDULED) + 5)
    c.assert_empty()


async def test_near_instance_stop_is_a_termination(emu: Emulator, collect: Callable) -> None:
    c = collect(watcher(emu.url))
    emu.notice("aws", "maintenance", 120, code="instance-stop")
    n = await c.next_notice()
    assert n.kind == "termination"
    emu.cancel("aws", state="completed")
    assert (await c.next_cancel()).id == n.id


async def test_scheduled_event_escalates_when_not_before_comes_near(
    emu: Emulator, collect: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aws_mod, "TERMINATION_THRESHOLD", timedelta(seconds=300))
    c = collect(watcher(emu.url))
    # NotBefore has second precision: 301.9 s ahead reads as 301 s, so it is not
    # near at first and becomes near within ~1-2 s.
    emu.notice("aws", "maintenance", 301.9, code="instance-retirement")
    first = await c.next_notice()
    assert first.kind == "maintenance"
    second = await c.next_notice(timeout=4)
    assert second.kind == "termination" and second.id != first.id
    emu.cancel("aws")
    cancelled = {(await c.next_cancel()).id, (await c.next_cancel()).id}
    assert cancelled == {first.id, second.id}


async def test_token_expiry_mid_run_is_handled(emu: Emulator, collect: Callable) -> None:
    emu.configure(aws_token_max_ttl=1)  # the server silently shortens every token to 1 s
    w = watcher(emu.url, poll_interval=0.05)
    c = collect(w)
    # First token at start; the second only after the first expired and a GET got 401.
    await emu.state.wait_requests("PUT", PATH_TOKEN, 2, timeout=6)
    assert [e for e in emu.state.request_log if e["status"] == 401]
    emu.notice("aws", "preemption", 120)
    assert (await c.next_notice()).kind == "preemption"
    assert w.health.healthy
    # Expired tokens were replaced after a 401 and the request retried: no error surfaced.
    assert "http_401" not in w.health.errors_by_reason


async def test_token_refreshed_before_expiry_when_ttl_is_honoured(emu: Emulator, collect: Callable) -> None:
    w = watcher(emu.url, token_ttl=2)
    c = collect(w)
    await emu.state.wait_requests("PUT", PATH_TOKEN, 2, timeout=5)
    await emu.state.wait_requests("GET", PATH_SPOT, emu.state.request_count("GET", PATH_SPOT) + 3)
    log_tail = list(emu.state.request_log)
    assert not [e for e in log_tail if e["status"] == 401], "refresh should come before expiry"
    c.assert_empty()
    assert w.health.errors == 0


async def test_revoked_token_401_retokens_and_retries_once(emu: Emulator, collect: Callable) -> None:
    w = watcher(emu.url)
    c = collect(w)
    await emu.state.wait_requests("GET", PATH_SPOT, 2)
    puts = emu.state.request_count("PUT", PATH_TOKEN)
    emu.state.tokens.clear()  # every outstanding token is now unknown → 401
    emu.notice("aws", "preemption", 120)
    assert (await c.next_notice()).kind == "preemption"
    assert emu.state.request_count("PUT", PATH_TOKEN) == puts + 1
    assert "http_401" not in w.health.errors_by_reason


async def test_persistent_401_is_an_error_then_recovers(emu: Emulator, collect: Callable, wait_until: Any) -> None:
    w = watcher(emu.url)
    c = collect(w)
    emu.fault("status", cloud="aws", path=PATH_SPOT, status=401)
    await wait_until(lambda: w.health.errors_by_reason.get("http_401", 0) >= 2, what="401 errors")
    emu.state.clear_faults()
    emu.notice("aws", "preemption", 120)
    assert (await c.next_notice()).kind == "preemption"
    await wait_until(lambda: w.health.healthy, what="recovery")


async def test_hung_token_put_warns_once_and_no_v1_fallback_when_v1_is_off(
    emu: Emulator, collect: Callable, wait_until: Any
) -> None:
    emu.configure(aws_token_put_hang=True)
    with capture_logs() as logs:
        w = watcher(emu.url)
        c = collect(w)
        emu.notice("aws", "preemption", 120)
        await wait_until(lambda: w.health.errors_by_reason.get("token_put_timeout", 0) >= 3, what="3 PUT timeouts")
        c.assert_empty()  # no token, no v1: nothing may be read
        assert not w.imdsv1
        warnings = [e for e in logs if e["event"] == "aws_token_put_timeout"]
        assert len(warnings) == 1, warnings
        assert warnings[0]["log_level"] == "warning"
        assert warnings[0]["fix"] == HOP_LIMIT_FIX
        assert "HttpPutResponseHopLimit to 2" in warnings[0]["fix"] and "host networking" in warnings[0]["fix"]
        # The hop limit gets fixed: the PUT is retried (with backoff) and succeeds.
        emu.configure(aws_token_put_hang=False)
        assert (await c.next_notice(timeout=5)).kind == "preemption"
        assert not w.imdsv1
    assert not [e for e in logs if e["event"] == "aws_imdsv1_fallback"]


async def test_hung_token_put_falls_back_to_imdsv1_when_the_instance_allows_it(
    emu: Emulator, collect: Callable
) -> None:
    emu.configure(aws_token_put_hang=True, aws_imdsv1=True)
    with capture_logs() as logs:
        w = watcher(emu.url)
        c = collect(w)
        emu.notice("aws", "preemption", 120)
        assert (await c.next_notice()).kind == "preemption"
    assert w.imdsv1
    assert [e["event"] for e in logs if e["event"].startswith("aws_token_put_timeout")] == ["aws_token_put_timeout"]
    fallback = [e for e in logs if e["event"] == "aws_imdsv1_fallback"]
    assert len(fallback) == 1 and fallback[0]["fix"] == HOP_LIMIT_FIX
    # Every GET after the fallback went without a token and was served.
    assert not [e for e in emu.state.request_log if e["status"] == 401]


async def test_imdsv1_switched_off_later_goes_back_to_tokens(emu: Emulator, collect: Callable) -> None:
    emu.configure(aws_token_put_hang=True, aws_imdsv1=True)
    w = watcher(emu.url)
    c = collect(w)
    await emu.state.wait_requests("GET", PATH_SPOT, 3)
    assert w.imdsv1
    emu.configure(aws_token_put_hang=False, aws_imdsv1=False)
    emu.notice("aws", "preemption", 120)
    assert (await c.next_notice()).kind == "preemption"
    assert not w.imdsv1


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_error_storm_backs_off_and_recovers(
    emu: Emulator, collect: Callable, wait_until: Any, status: int
) -> None:
    w = watcher(emu.url, poll_interval=0.01)
    c = collect(w)
    await emu.state.wait_requests("GET", PATH_SPOT, 1)
    emu.fault("status", cloud="aws", status=status, retry_after=0 if status == 429 else None)
    with capture_logs() as logs:
        await wait_until(lambda: w.health.errors_by_reason.get(f"http_{status}", 0) >= 8, what=f"{status} errors")
    assert not w.health.healthy
    lines = [e for e in logs if e["event"] == "aws_poll_error"]
    assert lines and all(e["reason"] == f"http_{status}" for e in lines)
    # Backoff: a storm does not turn into a tight loop (0.01 s polling would be ~100 cycles/s).
    before = emu.state.request_count("GET", PATH_SPOT)
    emu.notice("aws", "preemption", 120)
    emu.state.clear_faults()
    assert (await c.next_notice(timeout=3)).kind == "preemption"
    await wait_until(lambda: w.health.healthy, what="recovery")
    assert emu.state.request_count("GET", PATH_SPOT) - before < 40


async def test_storm_request_rate_is_bounded_by_backoff(emu: Emulator, collect: Callable) -> None:
    import asyncio

    w = watcher(emu.url, poll_interval=0.005, backoff_cap=0.4)
    collect(w)
    await emu.state.wait_requests("GET", PATH_SPOT, 1)
    emu.fault("status", cloud="aws", status=500)
    start = emu.state.request_count("GET", PATH_SPOT)
    await asyncio.sleep(1.5)  # measuring a rate over a window: the sleep *is* the measurement
    storm = emu.state.request_count("GET", PATH_SPOT) - start
    # Without backoff: ~300 cycles; with it (ceiling 0.4 s after a few doublings): a handful.
    assert storm < 20, storm


@pytest.mark.parametrize(
    "mode,reason",
    [("malformed", "bad_json"), ("content_type", "content_type"), ("hang", "timeout"), ("reset", "connection_reset")],
)
async def test_bad_responses_are_reported_and_recovered(
    emu: Emulator, collect: Callable, wait_until: Any, mode: str, reason: str
) -> None:
    w = watcher(emu.url)
    c = collect(w)
    emu.notice("aws", "preemption", 120)
    first = await c.next_notice()
    emu.cancel("aws")
    await emu.state.wait_requests("GET", PATH_SPOT, emu.state.request_count("GET", PATH_SPOT) + 2)
    emu.fault(mode, cloud="aws", path="/latest/meta-data/")
    emu.notice("aws", "preemption", 90)
    await wait_until(lambda: w.health.errors_by_reason.get(reason, 0) >= 2, what=f"{reason} errors")
    assert not w.health.healthy
    c.assert_empty()
    emu.state.clear_faults()
    n = await c.next_notice(timeout=3)
    assert n.kind == "preemption" and n.id != first.id
    await wait_until(lambda: w.health.healthy, what="recovery")


async def test_connection_refused_then_server_appears(closed_port_url: str, collect: Callable) -> None:
    await refused_then_server_appears(collect, watcher(closed_port_url), closed_port_url, "aws", "preemption", 120)


async def test_close_ends_the_iterator_promptly(emu: Emulator) -> None:
    import asyncio

    w = AwsWatcher(emu.url, poll_interval=30)
    events = w.events()
    task = asyncio.ensure_future(events.__anext__())
    await emu.state.wait_requests("GET", PATH_SPOT, 1)
    await w.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(task, 2)


def test_constructor_defaults() -> None:
    w = AwsWatcher()
    assert w.base_url == "http://169.254.169.254" and w.poll_interval == 0.5 and w.node is None
    with pytest.raises(ValueError):
        AwsWatcher(token_ttl=0)


async def test_spot_notice_cancelled_in_the_emulator_is_withdrawn(emu: Emulator, collect: Callable,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23's rehearsal trap: an emulator cancel left the notice in the daemon a minute past its
    deadline. A spot notice absent for SPOT_WITHDRAWN_AFTER (every poll a 404) is withdrawn."""
    monkeypatch.setattr(aws_mod, "SPOT_WITHDRAWN_AFTER", 0.3)
    c = collect(watcher(emu.url))
    emu.notice("aws", "preemption", 120)
    n = await c.next_notice()
    emu.cancel("aws")
    cancel = await c.next_cancel()
    assert cancel.id == n.id and cancel.source == "aws" and "404" in cancel.detail


async def test_spot_notice_briefly_absent_is_not_withdrawn(emu: Emulator, collect: Callable,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS never withdraws a spot notice: 404s shorter than the threshold (a metadata blip) cancel nothing."""
    monkeypatch.setattr(aws_mod, "SPOT_WITHDRAWN_AFTER", 3600.0)
    c = collect(watcher(emu.url))
    emu.notice("aws", "preemption", 120)
    await c.next_notice()
    emu.cancel("aws")
    await emu.state.wait_requests("GET", PATH_SPOT, emu.state.request_count("GET", PATH_SPOT) + 20)
    c.assert_empty()
