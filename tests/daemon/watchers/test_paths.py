"""Each metadata path on its own: a failing path never slows another, a blind path says why and how
to fix it, and the deadline/date/name details real clusters need. Real watchers against the real
emulator with its fault injection; intervals are measured from the emulator's request counts."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import pytest

from spotguard.daemon.watchers.aws import PATH_REBALANCE, PATH_SPOT, AwsWatcher
from spotguard.daemon.watchers.azure import PATH_COMPUTE, PATH_EVENTS, AzureWatcher, parse_azure_date
from spotguard.daemon.watchers.gcp import MAINTENANCE, PATH_PREFIX, PREEMPTED, UPCOMING, GcpWatcher
from spotguard.emulator.server import Emulator
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

INTERVAL = 0.1


async def mean_interval(emu: Emulator, method: str, path: str, n: int = 10, timeout: float = 10.0) -> float:
    """Seconds between requests to ``path``, averaged over the next ``n``."""
    start = emu.state.request_count(method, path)
    await emu.state.wait_requests(method, path, start + 1, timeout=timeout)
    t0 = time.monotonic()
    await emu.state.wait_requests(method, path, start + 1 + n, timeout=timeout)
    return (time.monotonic() - t0) / n


# --- AWS ------------------------------------------------------------------------------


@pytest.mark.serial
async def test_aws_failing_rebalance_path_never_slows_the_spot_path(emu: Emulator, collect: Callable,
                                                                   wait_until: Any) -> None:
    """A whole-cycle backoff (the old loop) polled every path every 1-2 s here (cap 2 s)."""
    emu.fault("status", cloud="aws", path=PATH_REBALANCE, status=500)
    w = AwsWatcher(emu.url, poll_interval=INTERVAL, put_timeout=0.5, request_timeout=0.5, backoff_cap=2.0)
    c = collect(w)
    spot = await mean_interval(emu, "GET", PATH_SPOT)
    assert spot < 5 * INTERVAL, f"spot polled every {spot:.3f}s while rebalance fails"  # loaded-machine margin
    rebalance = await mean_interval(emu, "GET", PATH_REBALANCE, n=3)
    assert rebalance > 3 * INTERVAL, f"the failing path backs off on its own ({rebalance:.3f}s)"
    t0 = time.monotonic()
    emu.notice("aws", "preemption", 120)
    n = await c.next_notice(timeout=5)
    assert n.kind == "preemption" and time.monotonic() - t0 < 2.0
    # And the watcher tells health checks exactly which path is blind.
    await wait_until(lambda: w.health.problem() is not None and PATH_REBALANCE in (w.health.problem() or ""),
                     what="rebalance named as the problem")
    assert PATH_SPOT not in (w.health.problem() or "")


async def test_aws_hop_limit_makes_the_watcher_blind_with_the_fix(emu: Emulator, collect: Callable,
                                                                 wait_until: Any) -> None:
    emu.configure(aws_token_put_hang=True)
    w = AwsWatcher(emu.url, poll_interval=INTERVAL, put_timeout=0.2, request_timeout=0.5, backoff_cap=0.3)
    collect(w)
    await wait_until(lambda: w.health.errors_by_reason.get("token_put_timeout", 0) >= 2, what="PUT timeouts")
    problem = w.health.problem()
    assert problem is not None and "HttpPutResponseHopLimit to 2" in problem and "hostNetwork" in problem, problem
    emu.configure(aws_token_put_hang=False)
    await wait_until(lambda: w.health.problem() is None, timeout=10, what="sees notices once the PUT answers")


async def test_aws_rebalance_recommendation_then_spot_notice(emu: Emulator, collect: Callable) -> None:
    emu.configure(aws_rebalance_lead=0.5)
    c = collect(AwsWatcher(emu.url, poll_interval=INTERVAL, request_timeout=0.5, backoff_cap=0.3))
    emu.notice("aws", "preemption", 120)
    first, second = await c.next_notice(), await c.next_notice()
    assert (first.kind, second.kind) == ("rebalance", "preemption") and first.id != second.id


# --- Azure -------------------------------------------------------------------------------


def azure(url: str, **kw: Any) -> AzureWatcher:
    return AzureWatcher(url, **{"poll_interval": INTERVAL, "request_timeout": 0.5, "backoff_cap": 2.0,
                                "min_request_spacing": 0.0, **kw})


@pytest.mark.serial
async def test_azure_failing_compute_never_slows_scheduled_events_and_vm_name_delivers(
        emu: Emulator, collect: Callable, wait_until: Any) -> None:
    emu.configure(azure_rate_limit=0)
    emu.fault("status", cloud="azure", path=PATH_COMPUTE, status=500)
    # Without a name: events are still read every interval, but none can be matched: blind, and said so.
    blind = azure(emu.url)
    c = collect(blind)
    interval = await mean_interval(emu, "GET", PATH_EVENTS)
    assert interval < 5 * INTERVAL, f"scheduledevents polled every {interval:.3f}s while compute fails"
    emu.notice("azure", "preemption", 60)
    await wait_until(lambda: "--azure-vm-name" in (blind.health.problem() or ""), what="the fix named")
    c.assert_empty()
    await c.stop()
    # With --azure-vm-name: compute is never asked, the Preempt arrives, the watcher sees notices.
    named = azure(emu.url, vm_name="vm-0")
    before = emu.state.request_count("GET", PATH_COMPUTE)
    n = await collect(named).next_notice()
    assert n.kind == "preemption" and named.node == "vm-0"
    await wait_until(lambda: named.health.problem() is None, what="healthy with the given name")
    assert emu.state.request_count("GET", PATH_COMPUTE) == before


async def test_azure_iso_8601_not_before(emu: Emulator, collect: Callable) -> None:
    emu.configure(azure_rate_limit=0, azure_iso_dates=True)
    c = collect(azure(emu.url))
    rec = emu.notice("azure", "termination", 600)
    n = await c.next_notice()
    assert abs((n.deadline - rec.deadline).total_seconds()) < 1.0


@pytest.mark.parametrize("text", ["Mon, 19 Sep 2016 18:29:47 GMT", "2016-09-19T18:29:47Z",
                                  "2016-09-19T18:29:47.1234567Z", "2016-09-19T18:29:47", "2016-09-19T20:29:47+02:00"])
def test_azure_dates_rfc1123_and_iso_8601(text: str) -> None:
    assert parse_azure_date(text).isoformat() == "2016-09-19T18:29:47+00:00" or text.endswith("567Z")
    assert abs(parse_azure_date(text).timestamp() - 1474309787) < 1


def test_azure_bad_date_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_azure_date("next tuesday")


# --- GCP -----------------------------------------------------------------------------------


def gcp(url: str) -> GcpWatcher:
    return GcpWatcher(url, wait_timeout_sec=30, request_timeout=0.5, backoff_cap=0.3)


async def test_gcp_404_on_preempted_names_the_gke_metadata_server(emu: Emulator, collect: Callable,
                                                                  wait_until: Any) -> None:
    emu.fault("status", cloud="gcp", path=PATH_PREFIX + PREEMPTED, status=404)
    w = gcp(emu.url)
    collect(w)
    await wait_until(lambda: w.health.errors_by_reason.get("http_404", 0) >= 2, what="404s")
    problem = w.health.problem()
    assert problem is not None and "GKE metadata server" in problem and "hostNetwork" in problem, problem
    assert MAINTENANCE not in problem


async def test_gcp_host_maintenance_deadline_is_the_upcoming_window(emu: Emulator, collect: Callable) -> None:
    c = collect(gcp(emu.url))
    rec = emu.notice("gcp", "termination", 3600)  # GPU VM: about an hour ahead
    n = await c.next_notice()
    assert n.kind == "termination" and abs((n.deadline - rec.deadline).total_seconds()) < 1.0, n
    assert UPCOMING in n.detail and "windowStartTime" in n.detail


@pytest.mark.serial
async def test_gcp_host_maintenance_without_window_gets_60_s(emu: Emulator, collect: Callable) -> None:
    emu.fault("status", cloud="gcp", path=PATH_PREFIX + UPCOMING, status=404)
    c = collect(gcp(emu.url))
    emu.notice("gcp", "termination", 3600)
    n = await c.next_notice()
    assert timedelta(seconds=55) < n.deadline - utcnow() <= timedelta(seconds=60), n
    assert isinstance(n, Notice) and UPCOMING not in n.detail
