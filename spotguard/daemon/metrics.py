"""Prometheus metrics (own registry) and the loopback ``/metrics`` + ``/healthz`` server.

Watcher counters live in each ``WatcherHealth`` (written by the watcher only), so
they are read at scrape time by a custom collector instead of being mirrored.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..notice import KINDS, SOURCES

__all__ = ["Metrics", "MetricsServer"]

# Fan-out is sub-millisecond; polling clouds add up to ~1 s: cover both ends.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CHECKPOINT_SECONDS_BUCKETS = (0.5, 1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600)
CHECKPOINT_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 42, 2))  # 1 MiB .. 2 TiB


class _WatcherCollector:
    """Reads ``WatcherHealth`` of the current watchers at each scrape."""

    def __init__(self, watchers: Callable[[], Sequence[Any]]) -> None:
        self._watchers = watchers

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        errors = CounterMetricFamily("spotguard_poll_errors", "Metadata poll errors by source and reason",
                                     labels=["source", "reason"])
        polls = CounterMetricFamily("spotguard_polls", "Metadata polls (ok or failed) by source", labels=["source"])
        healthy = GaugeMetricFamily("spotguard_watcher_healthy", "1 if the watcher's last poll succeeded",
                                    labels=["source"])
        seeing = GaugeMetricFamily("spotguard_watcher_seeing_notices",
                                   "1 if every path of the watcher answered well recently (what /healthz checks)",
                                   labels=["source"])
        for w in self._watchers():
            h = w.health
            polls.add_metric([h.source], h.polls)
            healthy.add_metric([h.source], 1.0 if h.healthy else 0.0)
            seeing.add_metric([h.source], 1.0 if h.problem() is None else 0.0)
            for reason, n in sorted(h.errors_by_reason.items()):
                errors.add_metric([h.source, reason], n)
        return [errors, polls, healthy, seeing]


class _LogSinkCollector:
    """The log stream's failures (``logsink.LogSink``), read at each scrape."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        errors = CounterMetricFamily("spotguard_log_write_errors", "Log lines lost to a failing log stream, by errno",
                                     labels=["reason"])
        for reason, n in sorted(self._sink.write_errors.items()):
            errors.add_metric([reason], n)
        dropped = CounterMetricFamily("spotguard_log_lines_dropped",
                                      "Log lines dropped because the log stream did not keep up")
        dropped.add_metric([], self._sink.dropped)
        return [errors, dropped]


class Metrics:
    """All ``spotguard_`` daemon metrics, in a registry of their own (no global state)."""

    def __init__(self, log_sink: Any = None) -> None:
        self.registry = CollectorRegistry()
        self.log_sink = log_sink
        r = self.registry
        self.notices = Counter("spotguard_notices", "Notices seen, by source and kind", ["source", "kind"],
                               registry=r)
        # Every source x kind exported at 0 from the start: Prometheus' increase() cannot see the
        # first notice of a series that first appears at 1 (deploy/prometheus alert rules rely on it).
        for source in SOURCES:
            for kind in KINDS:
                self.notices.labels(source, kind)
        self.cancels = Counter("spotguard_cancels", "Notices withdrawn by their source", ["source"], registry=r)
        self.delivery_latency = Histogram(
            "spotguard_delivery_latency_seconds",
            "Watcher saw the notice -> written to one subscriber's socket", buckets=LATENCY_BUCKETS, registry=r)
        self.subscribers = Gauge("spotguard_subscribers", "Connected subscribers", registry=r)
        self.checkpoint_seconds = Histogram("spotguard_checkpoint_seconds",
                                            "Emergency checkpoint duration reported by subscribers",
                                            buckets=CHECKPOINT_SECONDS_BUCKETS, registry=r)
        self.checkpoint_bytes = Histogram("spotguard_checkpoint_bytes", "Checkpoint bytes reported by subscribers",
                                          buckets=CHECKPOINT_BYTES_BUCKETS, registry=r)
        self.checkpoint_failures = Counter("spotguard_checkpoint_failures", "checkpoint_failed reports",
                                           registry=r)
        self.disconnects = Counter("spotguard_client_disconnects", "Clients dropped by the daemon, by reason",
                                   ["reason"], registry=r)
        self.watcher_restarts = Counter("spotguard_watcher_restarts", "Watcher loops restarted after a crash",
                                        ["source"], registry=r)
        self.actions = Counter("spotguard_actions", "Cluster actions (webhook, slack, kubernetes, asg) by phase "
                               "(notice/outcome) and result (ok/failed)", ["action", "phase", "result"], registry=r)
        self._watchers: list[Any] = []
        r.register(_WatcherCollector(lambda: self._watchers))
        if log_sink is not None:
            r.register(_LogSinkCollector(log_sink))

    def log_write_errors(self) -> dict[str, int]:
        """Log lines lost so far, by errno name (``dropped``: the stream did not keep up)."""
        if self.log_sink is None:
            return {}
        return {**self.log_sink.write_errors, **({"dropped": self.log_sink.dropped} if self.log_sink.dropped else {})}

    def set_watchers(self, watchers: Sequence[Any]) -> None:
        self._watchers = list(watchers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """aiohttp on 127.0.0.1 only: metrics are not for the network at large."""

    def __init__(self, metrics: Metrics, port: int, health: Callable[[], tuple[bool, dict[str, Any]]],
                 host: str = "127.0.0.1") -> None:
        self.metrics = metrics
        self.port = port
        self.host = host
        self._health = health
        self._runner: Optional[web.AppRunner] = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, detail = self._health()
        return web.json_response({"ok": ok, **detail}, status=200 if ok else 503)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
