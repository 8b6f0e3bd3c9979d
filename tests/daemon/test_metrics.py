"""Prometheus /metrics and /healthz on 127.0.0.1, fed by real traffic."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from spotguard.daemon.app import StartupError
from spotguard.daemon.client import Subscription, request
from spotguard.daemon.metrics import Metrics
from spotguard.protocol import Drill, DrillOk

from .conftest import FakeWatcher, running_daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(text: str, name: str) -> float:
    """Value of the first exposition line starting with ``name`` (labels included in ``name``)."""
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics:\n{text}")


async def test_metrics_after_drill_and_checkpoint(sock_path: str) -> None:
    port = free_port()
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w], metrics_port=port):
        sub = await Subscription(sock_path).open()
        reply = await request(sock_path, Drill(kind="preemption", deadline_in=30))
        assert isinstance(reply, DrillOk)
        await sub.next_notice(timeout=5)
        await sub.checkpoint_done(reply.id, step=9, uri="file:///c", nbytes=3 * 2**20, seconds=4.2)
        w.health.error("http_503", "503 from metadata")
        w.health.error("http_503", "503 from metadata")
        w.health.error("timeout", "timed out")
        await sub.status()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
                health = await r.json()
        assert sample(text, 'spotguard_notices_total{kind="preemption",source="drill"}') == 1
        assert sample(text, "spotguard_delivery_latency_seconds_count") == 1
        assert sample(text, "spotguard_subscribers") == 1
        assert sample(text, "spotguard_checkpoint_seconds_count") == 1
        assert sample(text, "spotguard_checkpoint_seconds_sum") == pytest.approx(4.2)
        assert sample(text, "spotguard_checkpoint_bytes_sum") == 3 * 2**20
        assert sample(text, 'spotguard_poll_errors_total{reason="http_503",source="aws"}') == 2
        assert sample(text, 'spotguard_poll_errors_total{reason="timeout",source="aws"}') == 1
        assert sample(text, 'spotguard_polls_total{source="aws"}') == 3
        assert sample(text, 'spotguard_watcher_healthy{source="aws"}') == 0
        assert sample(text, 'spotguard_watcher_healthy{source="signal"}') == 1
        assert health["ok"] is True and health["watchers"] == {"aws": False, "signal": True}
        await sub.close()


async def test_metrics_listen_on_loopback_only(sock_path: str) -> None:
    port = free_port()
    async with running_daemon(sock_path, metrics_port=port) as d:
        sockets = d.metrics_server._runner.addresses
        assert sockets and all(addr[0] == "127.0.0.1" for addr in sockets)


async def test_metrics_port_in_use_is_startup_error(sock_path: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StartupError, match="--metrics-port"):
            async with running_daemon(sock_path, metrics_port=port):
                pass


def test_own_registry() -> None:
    a, b = Metrics(), Metrics()  # no "Duplicated timeseries" from a global registry
    a.notices.labels("aws", "preemption").inc()
    assert b'spotguard_notices_total{kind="preemption",source="aws"} 0.0' in b.render()


def test_notice_series_start_at_zero() -> None:
    """Every source x kind is exported before its first notice, so that Prometheus' increase()
    counts the first one (deploy/prometheus/spotguard-alerts.yaml relies on it)."""
    text = Metrics().render().decode()
    assert text.count("spotguard_notices_total{") == 20
    assert 'spotguard_notices_total{kind="termination",source="gcp"} 0.0' in text
