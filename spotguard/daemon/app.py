"""``spotguard daemon``: watchers -> notice book -> Unix-socket fan-out, plus operations.

The daemon must outlive everything that can go wrong around it: a watcher that
raises is logged and restarted with backoff; a bad client is dropped alone; a
log stream that fails or stalls costs log lines, never a notice (``logsink.py``:
notices are broadcast first, then logged).

Its own SIGTERM is, by default, a clean stop in well under 2 s: a DaemonSet
rollout, ``helm upgrade`` or ``systemctl restart spotguard`` must never stop
training; trainers keep training, their intakes reconnect to the successor on
the same socket path (which is removed on exit, and the active notices' state
file kept). With ``--sigterm-notice`` (for set-ups where the trainer gets no
signal of its own) the SIGTERM becomes a ``termination`` notice and the daemon
keeps serving until every subscriber reported its checkpoint (or left) or the
grace deadline passed, then exits 0.

Why apart from ``noticeloop.py``: this module is the wiring (build the parts, start them in order, signals,
housekeeping, the systemd watchdog, a bounded shutdown, the CLI); what happens to each notice and subscriber
once it runs is ``NoticeLoop``'s, which is given its parts here and asks back only for what its ``Wiring``
names. A change to start-up or shutdown order is read here alone.
"""

from __future__ import annotations

import argparse
import asyncio
# asyncio.to_thread's executor (the state file writer), loaded at import: a daemon started as root that then
# drops privileges may not be able to read the standard library any more.
import concurrent.futures.thread  # noqa: F401
import os
import signal
import socket
import sys
import time
from typing import Any, Optional, Sequence

from ..logs import configure_logging, get_logger
from ..timefmt import to_rfc3339, utcnow
from ..version import __version__
from . import status as status_mod
from .actions import ActionError, ActionRunner
from .book import Entry, NoticeBook
from .config import ConfigError, DaemonConfig, add_arguments as _add_config_arguments
from .logsink import LogSink
from .metrics import Metrics, MetricsServer
from .noticeloop import NoticeLoop
from .persist import state_path_for
from .reports import Reports
from .sdnotify import SdNotifier
from .server import Server, ServerStartError, SocketInUse
from .statefile import StateKeeper
from .supervise import WatchersUnbuildable, WatcherSupervisor, build_watchers, resolve_cloud
from .watchers.base import Watcher
from .watchers.signal import SignalWatcher

__all__ = ["Daemon", "StartupError", "add_arguments", "main"]

log = get_logger("spotguard.daemon")

# Seconds ``spotguard daemon`` waits for a predecessor still serving its socket (an overlapping rollout).
TAKEOVER_WAIT = 5.0


class StartupError(RuntimeError):
    """The daemon cannot start; ``str()`` is one line naming the fix (exit 2)."""


class Daemon:
    """One per VM. ``await Daemon(cfg).run()`` returns the exit code."""

    def __init__(self, config: DaemonConfig, *, watchers: Optional[Sequence[Watcher]] = None,
                 metrics: Optional[Metrics] = None, notifier: Optional[SdNotifier] = None,
                 install_signals: bool = True, restart_backoff: tuple[float, float] = (0.5, 30.0),
                 expire_margin: float = 60.0, housekeeping_interval: float = 1.0,
                 write_timeout: float = 10.0, state_path: Optional[str] = "", takeover_wait: float = 0.0) -> None:
        self.config = config
        self.book = NoticeBook(expire_margin=expire_margin)
        # Active notices survive a daemon restart with their ids ("" = next to the socket, None = off).
        self.keeper = StateKeeper(state_path_for(config.socket) if state_path == "" else state_path, self.book,
                                  expire_margin=expire_margin)
        self.state = self.keeper.state
        self.metrics = metrics or Metrics()
        self.sd = notifier if notifier is not None else SdNotifier()
        self.signal_watcher = SignalWatcher()
        self.cloud = config.cloud
        self.watchers: list[Watcher] = []
        self._given_watchers = None if watchers is None else list(watchers)
        self.install_signals = install_signals
        self.housekeeping_interval = housekeeping_interval
        self.write_timeout = write_timeout
        self.takeover_wait = takeover_wait
        self.metrics_server: Optional[MetricsServer] = None
        self.uid = os.getuid()
        self.started_monotonic = time.monotonic()
        self.shutting_down: Optional[str] = None
        self.exit_code = 0
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self._stop = asyncio.Event()
        progress = asyncio.Event()  # a subscriber reported or left: re-check the shutdown condition
        # ``ingest`` looked up per event (not bound now), as before the supervisor was its own object
        self.supervisor = WatcherSupervisor(lambda event, w: self.ingest(event, w), self.metrics, self._stop,
                                            restart_backoff)
        self._tasks: list[asyncio.Task[Any]] = []
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._signals: list[int] = []
        self._shut = False
        # Cluster actions (webhooks, Kubernetes, ASG lifecycle): off the delivery path, see actions/.
        self.actions = ActionRunner([], node=self.node, counter=self.metrics.actions,
                                    reconnect_grace=config.reconnect_grace, on_change=self.keeper.save,
                                    persist=self.keeper.persist)
        self.keeper.attach(self.actions)
        self.reports = Reports(self.book, self.actions, self.metrics, config, progress, self._spawn)
        # What happens to a notice and a subscriber once everything runs (noticeloop.py); the server's handler.
        self.notices = NoticeLoop(self, book=self.book, keeper=self.keeper, actions=self.actions,
                                  reports=self.reports, metrics=self.metrics, sd=self.sd, progress=progress,
                                  uid=self.uid)

    @property
    def server(self) -> Optional[Server]:
        """The socket server, once built (``start``); the notice loop holds it, the wiring starts and closes it."""
        return self.notices.server

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> int:
        """Start, serve until stopped, shut down; ``StartupError`` if it cannot start."""
        try:
            await self.start()
        except BaseException:
            await self.shutdown()
            raise
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()
        return self.exit_code

    def request_stop(self, code: int = 0) -> None:
        self.exit_code = code
        self._stop.set()

    async def start(self) -> None:
        cfg = self.config
        self.cloud = await resolve_cloud(cfg)
        try:
            built = self._given_watchers if self._given_watchers is not None else await build_watchers(cfg, self.cloud)
        except WatchersUnbuildable as exc:
            raise StartupError(str(exc)) from None
        self.watchers = [*built, self.signal_watcher]
        for w in self.watchers:
            w.health.stale_after = cfg.health_stale_after
        self.metrics.set_watchers(self.watchers)
        server = self.notices.server = Server(
            cfg.socket, self.notices, max_subscribers=cfg.max_subscribers, queue_size=cfg.send_queue,
            ping_interval=cfg.ping_interval, write_timeout=self.write_timeout, socket_gid=cfg.socket_gid)
        try:
            await self._start_server(server)
        except ServerStartError as exc:
            self.notices.server = None
            raise StartupError(str(exc)) from None
        await self._start_actions()
        await asyncio.to_thread(lambda: None)  # the state writer's thread exists before the first notice
        # Only now: the socket is ours, so no live daemon is using the state file beside it.
        self.keeper.load(then=self._restore_action_state)
        self._reconcile_cluster("start")
        if cfg.metrics_port:
            self.metrics_server = MetricsServer(self.metrics, cfg.metrics_port, self._health)
            try:
                await self.metrics_server.start()
            except OSError as exc:
                self.metrics_server = None
                raise StartupError(f"cannot serve metrics on 127.0.0.1:{cfg.metrics_port} ({exc.strerror}): choose "
                                   "another --metrics-port, or 0 to turn metrics off") from None
        if self.install_signals:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
            loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            self._signals = [signal.SIGTERM, signal.SIGINT]
        self.supervisor.start(self.watchers)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="spotguard-housekeeping"))
        if self.sd.watchdog_interval:
            self._tasks.append(asyncio.create_task(self._watchdog(self.sd.watchdog_interval), name="sd-watchdog"))
        log.info("daemon.ready", socket=cfg.socket, cloud=self.cloud, sources=self.sources(), node=self.node(),
                 pid=os.getpid(), uid=self.uid, metrics_port=cfg.metrics_port or None, version=__version__)
        self.sd.ready(self.sd_status())
        self.ready.set()

    async def _start_server(self, server: Server) -> None:
        """Bind the socket; a predecessor still stopping on it (a rollout that overlaps) gets
        ``takeover_wait`` seconds to go (it stops in <= 2 s), then ``SocketInUse`` stands."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.takeover_wait
        while True:
            try:
                await server.start()
                return
            except SocketInUse:
                if loop.time() >= end:
                    raise
                log.debug("socket.busy_waiting", socket=self.config.socket,
                          detail="another daemon still serves this socket; waiting for it to stop")
                await asyncio.sleep(0.1)

    async def shutdown(self) -> None:
        """Idempotent: stop serving, stop watchers, remove the socket."""
        if self._shut:
            return
        self._shut = True
        self.keeper.closed = True
        self._stop_deciding()
        self.sd.stopping(f"stopping ({self.shutting_down or 'requested'})")
        if self._signals:
            loop = asyncio.get_running_loop()
            for sig in self._signals:
                loop.remove_signal_handler(sig)
        tasks = [*self.supervisor.tasks(), *self._tasks, *self._side_tasks]
        term = self.notices.termination_task
        if term is not None and term is not asyncio.current_task():
            tasks.append(term)
        for t in tasks:
            t.cancel()
        # Bounded all along (a successor is waiting for the socket path): <= ~1.5 s in all.
        if self.server is not None:
            await self.server.close(flush_timeout=0.3)
        await self.actions.close()  # a webhook still in flight gets a bounded moment (actions.DRAIN_SECONDS)
        if tasks:
            await asyncio.wait(tasks, timeout=0.4)
        closes = [asyncio.ensure_future(self._close_watcher(w)) for w in self.watchers]
        if closes:
            await asyncio.wait(closes, timeout=0.4)
        await self.keeper.flush()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        self.sd.close()
        if self.ready.is_set():  # a failed start is reported by main's one error line only
            log.info("daemon.stopped", exit_code=self.exit_code, reason=self.shutting_down or "requested")
        self.stopped.set()

    async def _start_actions(self) -> None:
        from .actions.registry import build_actions

        try:
            self.actions.actions = build_actions(self.config)
            await self.actions.start()
        except ActionError as exc:
            raise StartupError(str(exc)) from None

    @staticmethod
    async def _close_watcher(w: Watcher) -> None:
        try:
            await w.close()
        except Exception as exc:  # a watcher's close must not block shutdown
            log.warning("watcher.close_failed", source=w.source, error=repr(exc))

    def ingest(self, event: Any, watcher: Optional[Watcher] = None) -> Optional[Entry]:
        """One event from a source (the notice loop's one entry, kept here for the callers of ``Daemon``)."""
        return self.notices.ingest(event, watcher)

    def _restore_action_state(self) -> None:
        """Hand the action state of the notices an earlier life persisted to the action runner."""
        from .actions import ActionState

        restarted = bool(self.keeper.persisted) or self.state.subscribers > 0 or bool(self.server and self.server.found_stale)
        self.actions.restore({nid: ActionState.from_dict(doc) for nid, doc in self.state.actions.items()},
                             restarted=restarted, earlier_subscribers=self.state.subscribed)

    def _stop_deciding(self) -> None:
        """From the first moment of a stop: the disconnects of our own shutdown are not the trainers' outcome;
        the next daemon life decides it (the notice and its action state stay in the state file)."""
        self.actions.stopping = True
        self.keeper.subscribers_at_stop = 0 if self.server is None else len(self.server.subscribers())

    # --- shutdown on SIGTERM --------------------------------------------------

    def _on_sigterm(self) -> None:
        if self._stop.is_set():
            return
        if not self.config.sigterm_notice:
            # A rollout, an upgrade, a restart: the trainers are not going anywhere.
            log.info("signal.received", signal="SIGTERM", detail="clean stop; trainers keep training and reconnect "
                     "to the next daemon on this socket (--sigterm-notice makes SIGTERM a termination notice)")
            self.shutting_down = self.shutting_down or "SIGTERM"
            self.request_stop(0)
            return
        notice = self.signal_watcher.trigger(self.config.sigterm_grace)
        if notice is None:
            log.info("signal.repeated", signal="SIGTERM", detail="already shutting down")
            return
        self.shutting_down = "SIGTERM"
        log.info("signal.received", signal="SIGTERM", notice_id=notice.id, grace_seconds=self.config.sigterm_grace)

    def _on_sigint(self) -> None:
        log.info("signal.received", signal="SIGINT", detail="plain shutdown")
        self.shutting_down = self.shutting_down or "SIGINT"
        self.request_stop(0)

    # --- who this VM is (the hello, status) -------------------------------------------

    def node(self) -> str:
        if self.config.node:
            return self.config.node
        for w in self.watchers:
            name = getattr(w, "node", None)
            if isinstance(name, str) and name:
                return name
        return socket.gethostname()

    def sources(self) -> list[str]:
        out: list[str] = []
        for s in [*(w.source for w in self.watchers), "signal", "drill"]:
            if s not in out:
                out.append(s)
        return out

    def _spawn(self, coro: Any) -> None:
        """A side task (Azure approval, a cluster reconcile): kept so that shutdown cancels it."""
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # --- operations (status.py) ------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def status(self, compact: bool = False) -> dict[str, Any]:
        """The ``status`` reply; ``compact`` lists at most 32 subscribers and counts states per notice."""
        return status_mod.status(self, compact)

    def health(self) -> tuple[bool, list[str]]:
        return status_mod.health(self)

    def checkpoint_pending(self) -> dict[str, Any]:
        return status_mod.checkpoint_pending(self)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        return status_mod.health_doc(self)

    def sd_status(self) -> str:
        return status_mod.sd_status(self)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.housekeeping_interval)
            expired = self.book.expire()
            for entry in expired:
                log.info("notice.expired", notice_id=entry.id, source=entry.notice.source,
                         deadline=to_rfc3339(entry.notice.deadline),
                         detail="deadline passed and the VM is still here; no longer replayed")
                self.keeper.expired(entry.id)
            if expired:
                self.keeper.save()
                self._reconcile_cluster("expired")

    # --- cluster actions: undo spotguard's cordon once the VM outlived its notices ---------

    def _reconcile_cluster(self, why: str) -> None:
        """At start and on expiry (cancel goes through ``actions.cancelled``): actions with a ``reconcile``
        (Kubernetes: uncordon) get the active notices and run in the background; a restored notice that
        is never re-seen gets one more reconcile when it would have expired."""
        actions = [a for a in self.actions.actions if hasattr(a, "reconcile")]
        if not actions:
            return
        for a in actions:
            a.active = self.keeper.cluster_active_ids  # type: ignore[attr-defined]
            self._spawn(a.reconcile(why))  # type: ignore[attr-defined]
        end = self.keeper.last_restored_end() if why == "start" else None
        if end is not None:
            delay = (end - utcnow()).total_seconds() + 1.0
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, self._reconcile_cluster, "expired")

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.sd.watchdog()
            await asyncio.sleep(interval)


# --- CLI -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """``spotguard daemon``: 0 on a clean stop, 2 on bad configuration."""
    try:
        cfg = DaemonConfig.from_args(args)
    except ConfigError as exc:
        print(f"spotguard daemon: error: {exc}", file=sys.stderr)
        return 2
    sink = LogSink.for_stderr()
    configure_logging(cfg.log_format, cfg.log_level, stream=sink)  # type: ignore[arg-type]

    async def _run() -> int:
        return await Daemon(cfg, metrics=Metrics(log_sink=sink), takeover_wait=TAKEOVER_WAIT).run()

    try:
        return asyncio.run(_run())
    except StartupError as exc:
        sink.write(f"spotguard daemon: error: {exc}\n")
        return 2
    finally:
        sink.close(timeout=1.0)


def _standalone(argv: Optional[list[str]] = None) -> int:
    """``python -m spotguard.daemon.app`` (same flags as ``spotguard daemon``)."""
    parser = argparse.ArgumentParser(prog="spotguard daemon")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
