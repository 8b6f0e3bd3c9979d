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

from spotguard.launch import Emulator, start_daemon, start_emulator

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
        status, body = until(lambda: (r := healthz(port))[1]["problems"] and r, 15, "a reported problem")
        assert status == 503 and body["ok"] is False and body["serving"] is True, body
        assert body["seeing_notices"][cloud] is False
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
