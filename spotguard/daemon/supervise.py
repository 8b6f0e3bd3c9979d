"""Which watchers the daemon runs, and keeping each one running.

Why apart from ``app.py``: choosing the cloud (flag or detection), building its watchers and restarting a
watcher that crashed are the daemon's wiring, not its notice loop; the loop only receives events
(``ingest``), and ``status`` only asks whether a watcher runs and how often it was restarted.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Optional

from ..logs import get_logger
from .config import DaemonConfig
from .metrics import Metrics
from .watchers.base import Backoff, Watcher

__all__ = ["WatcherSupervisor", "resolve_cloud", "build_watchers", "WatchersUnbuildable"]

log = get_logger("spotguard.daemon")


class WatchersUnbuildable(RuntimeError):
    """The watchers of the chosen cloud could not be built; ``str()`` names the fix."""


async def resolve_cloud(cfg: DaemonConfig) -> str:
    """``--cloud``, or with ``auto`` the detected cloud ("none" when detection fails: SIGTERM and drills only)."""
    if cfg.cloud != "auto":
        return cfg.cloud
    try:
        from .watchers.detect import detect_cloud

        kwargs = {"dmi_root": cfg.dmi_root, "probe_base_url": cfg.metadata_url}
        if inspect.iscoroutinefunction(detect_cloud):
            cloud = await detect_cloud(**kwargs)
        else:
            cloud = await asyncio.to_thread(detect_cloud, **kwargs)
    except Exception as exc:
        log.warning("cloud.detect_failed", error=repr(exc), fallback="none",
                    fix="pass --cloud aws|gcp|azure explicitly")
        return "none"
    cloud = str(cloud or "none")
    log.info("cloud.detected", cloud=cloud, dmi_root=cfg.dmi_root)
    if cloud == "none":
        log.warning("cloud.none", detail="no cloud detected: watching SIGTERM and drills only",
                    fix="pass --cloud aws|gcp|azure if this is a cloud VM")
    return cloud


async def build_watchers(cfg: DaemonConfig, cloud: str) -> list[Watcher]:
    """The metadata watchers of ``cloud`` (none for "none"); ``WatchersUnbuildable`` names the fix."""
    if cloud == "none":
        return []
    try:
        from .watchers.registry import build_watchers as _build

        result = _build(cloud, cfg.metadata_url, cfg.poll_interval, azure_vm_name=cfg.azure_vm_name or None)
        if inspect.isawaitable(result):
            result = await result
    except Exception as exc:
        raise WatchersUnbuildable(f"cannot build the {cloud} watchers ({type(exc).__name__}: {exc}); check "
                                  "--cloud and --metadata-url") from None
    return list(result)


class WatcherSupervisor:
    """One task per watcher; a crash is logged, counted and restarted with backoff."""

    def __init__(self, ingest: Callable[[Any, Optional[Watcher]], Any], metrics: Metrics, stop: asyncio.Event,
                 restart_backoff: tuple[float, float]) -> None:
        self._ingest = ingest
        self._metrics = metrics
        self._stop = stop
        self._backoff = restart_backoff
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._restarts: dict[str, int] = {}

    def start(self, watchers: list[Watcher]) -> None:
        for w in watchers:
            self._tasks[id(w)] = asyncio.create_task(self._supervise(w), name=f"watcher-{w.source}")

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks.values())

    def running(self, w: Watcher) -> bool:
        task = self._tasks.get(id(w))
        return task is not None and not task.done()

    def restarts(self, source: str) -> int:
        return self._restarts.get(source, 0)

    async def _supervise(self, w: Watcher) -> None:
        """Run one watcher forever."""
        base, cap = self._backoff
        backoff = Backoff(base=base, cap=cap)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                async for event in w.events():
                    try:
                        self._ingest(event, w)
                    except Exception as exc:
                        log.error("notice.ingest_failed", source=w.source, error=repr(exc), exc_info=True)
                if self._stop.is_set():
                    return
                log.warning("watcher.ended", source=w.source, detail="events() returned; restarting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.error("watcher.crashed", source=w.source, error=f"{type(exc).__name__}: {exc}", exc_info=True)
                try:
                    w.health.error("crash", f"{type(exc).__name__}: {exc}")
                except Exception:
                    pass
            self._restarts[w.source] = self._restarts.get(w.source, 0) + 1
            self._metrics.watcher_restarts.labels(w.source).inc()
            if loop.time() - started > 60:
                backoff.reset()
            delay = backoff.next_delay()
            log.info("watcher.restarting", source=w.source, in_seconds=round(delay, 3),
                     restarts=self._restarts[w.source])
            await asyncio.sleep(delay)
