"""Health means "I can see notices": real daemons against the real emulator (separate processes).

``/healthz`` and ``spotguard status --check`` fail until every metadata watcher has had a good
answer (a metadata server answering 404 to everything is GKE's under Workload Identity), name
the cause and the fix, pass once the server answers, and fail again when answers stop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator

import pytest

from spotguard.launch import Emulator, query_status, start_daemon, start_emulator

CLI = [sys.executable, "-m", "spotguard"]
FIX_WORDS = {"aws": "/latest/api/token", "gcp": "GKE metadata server", "azure": "/metadata/scheduledevents"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:  # noqa: S310
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check(sock: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", "--check", "--socket", sock], capture_output=True, text=True, timeout=30)


def until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """A daemon in another process: its state can only be polled."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    emu = start_emulator()
    try:
        emu.control("config", {"azure_rate_limit": 0})
        yield emu
    finally:
        emu.stop()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_healthz_is_503_against_a_404_only_server_and_200_against_a_working_one(
        emulator: Emulator, sockdir: str, cloud: str) -> None:
    emulator.control("fault", {"mode": "status", "cloud": "*", "status": 404})
    sock, port = os.path.join(sockdir, "h.sock"), free_port()
    d = start_daemon(sock, cloud=cloud, metadata_url=emulator.url,
                     extra_args=["--metrics-port", str(port), "--poll-interval", "0.1"])
    try:
        assert healthz(port)[0] == 503  # nothing answered yet: blind until proven otherwise
        # 503 from the start; once the first answers (404s) are in, the problem names the cause.
        status, body = until(lambda: FIX_WORDS[cloud] in " ".join((r := healthz(port))[1]["problems"]) and r, 20,
                             "the 404s reported with their cause")
        assert status == 503 and body["ok"] is False and body["serving"] is True, body
        assert body["seeing_notices"][cloud] is False
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310
            assert f'spotguard_watcher_seeing_notices{{source="{cloud}"}} 0.0' in r.read().decode()
        assert any(cloud in p and FIX_WORDS[cloud] in p for p in body["problems"]), body["problems"]
        blind = check(sock)
        assert blind.returncode == 1, blind
        assert FIX_WORDS[cloud] in blind.stderr, blind.stderr
        emulator.control("fault/clear")
        status, body = until(lambda: (r := healthz(port))[0] == 200 and r, 20, "healthy once the server answers")
        assert body["ok"] is True and body["problems"] == [] and body["seeing_notices"][cloud] is True
        ok = check(sock)
        assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok
    finally:
        d.stop()


def test_health_fails_again_when_answers_stop(emulator: Emulator, sockdir: str) -> None:
    sock, port = os.path.join(sockdir, "s.sock"), free_port()
    d = start_daemon(sock, cloud="aws", metadata_url=emulator.url,
                     extra_args=["--metrics-port", str(port), "--poll-interval", "0.05", "--health-stale-after", "1"])
    try:
        until(lambda: healthz(port)[0] == 200, 15, "healthy")
        emulator.control("fault", {"mode": "status", "cloud": "aws", "status": 500})
        status, body = until(lambda: (r := healthz(port))[0] == 503 and r, 15, "stale")
        assert any("no good answer for" in p for p in body["problems"]), body
        assert check(sock).returncode == 1
    finally:
        d.stop()


def test_status_check_without_daemon_fails(sockdir: str) -> None:
    out = check(os.path.join(sockdir, "nobody.sock"))
    assert out.returncode == 1 and "no spotguard daemon" in out.stderr


# --- the same details through a real daemon process -----------------------------------------


def _state(emu: Emulator) -> dict[str, Any]:
    with urllib.request.urlopen(f"{emu.url}/_emulator/state", timeout=5) as r:  # noqa: S310
        return dict(json.loads(r.read()))


def _first_notice(sock: str, timeout: float = 20.0) -> dict[str, Any]:
    return dict(until(lambda: (s := query_status(sock))["active_notices"] and s["active_notices"][0], timeout,
                      "a notice in the daemon"))


@pytest.mark.serial
def test_real_daemon_polls_a_good_path_on_time_beside_a_failing_one(emulator: Emulator, sockdir: str) -> None:
    spot, rebalance = "/latest/meta-data/spot/instance-action", "/latest/meta-data/events/recommendations/rebalance"
    emulator.control("fault", {"mode": "status", "cloud": "aws", "path": rebalance, "status": 500})
    sock = os.path.join(sockdir, "p.sock")
    d = start_daemon(sock, cloud="aws", metadata_url=emulator.url, extra_args=["--poll-interval", "0.2"])
    try:
        until(lambda: _state(emulator)["requests"].get(f"GET {spot}", 0) > 0, 15, "first spot poll")
        c0, t0 = _state(emulator)["requests"], time.monotonic()
        until(lambda: _state(emulator)["requests"].get(f"GET {spot}", 0) >= c0[f"GET {spot}"] + 10, 15, "10 polls")
        c1, t1 = _state(emulator)["requests"], time.monotonic()
        spot_interval = (t1 - t0) / (c1[f"GET {spot}"] - c0[f"GET {spot}"])
        assert spot_interval < 0.8, f"spot polled every {spot_interval:.3f}s beside a failing rebalance path"
        assert c1.get(f"GET {rebalance}", 0) - c0.get(f"GET {rebalance}", 0) < c1[f"GET {spot}"] - c0[f"GET {spot}"]
        emulator.notice("aws", "preemption", 120)
        assert _first_notice(sock)["kind"] == "preemption"
    finally:
        d.stop()


def test_real_daemon_azure_vm_name_option_delivers_without_compute(emulator: Emulator, sockdir: str) -> None:
    emulator.control("fault", {"mode": "status", "cloud": "azure", "path": "/metadata/instance/compute",
                               "status": 500})
    sock = os.path.join(sockdir, "a.sock")
    d = start_daemon(sock, cloud="azure", metadata_url=emulator.url, env={"SPOTGUARD_AZURE_VM_NAME": "vm-0"})
    try:
        emulator.notice("azure", "preemption", 60)
        notice = _first_notice(sock)
        assert notice["kind"] == "preemption" and notice["source"] == "azure"
        assert check(sock).returncode == 0
        assert _state(emulator)["requests"].get("GET /metadata/instance/compute", 0) == 0
    finally:
        d.stop()


def test_real_daemon_gcp_gpu_maintenance_deadline_is_the_window(emulator: Emulator, sockdir: str) -> None:
    sock = os.path.join(sockdir, "g.sock")
    d = start_daemon(sock, cloud="gcp", metadata_url=emulator.url)
    try:
        rec = emulator.notice("gcp", "termination", 3600)
        notice = _first_notice(sock)
        assert notice["kind"] == "termination"
        assert 3500 < notice["seconds_left"] <= 3600 and notice["deadline"][:19] == rec["deadline"][:19], notice
    finally:
        d.stop()
