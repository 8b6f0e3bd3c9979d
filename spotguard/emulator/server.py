"""``spotguard emulate``: one loopback aiohttp server for AWS, GCP and Azure metadata.

Used three ways: the CLI (prints a JSON ``listening`` line, runs until
SIGTERM/SIGINT), ``running_emulator()`` for in-process tests, and
``create_app()`` for callers that manage their own aiohttp runner.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
from typing import Any, AsyncIterator, Optional

from aiohttp import web

from ..logs import configure_logging
from ..logs import get_logger

log = get_logger("spotguard.emulator")
from . import aws, azure, control, gcp
from .state import STATE_KEY, EmulatorConfig, EmulatorState, Fault, NoticeRecord

__all__ = ["create_app", "running_emulator", "Emulator", "add_arguments", "main", "serve"]


# Hanging handlers are released by ``EmulatorState.close`` on shutdown, so a
# short grace is plenty and keeps test teardown fast.
SHUTDOWN_TIMEOUT = 2.0


def create_app(config: Optional[EmulatorConfig] = None, state: Optional[EmulatorState] = None) -> web.Application:
    """The aiohttp application; the state is at ``app[STATE_KEY]``."""
    app = web.Application(middlewares=[control.count_middleware, control.fault_middleware])
    st = state if state is not None else EmulatorState(config)
    app[STATE_KEY] = st

    async def on_shutdown(_app: web.Application) -> None:
        st.close()

    app.on_shutdown.append(on_shutdown)
    control.add_routes(app)
    aws.add_routes(app)
    gcp.add_routes(app)
    azure.add_routes(app)
    return app


@dataclasses.dataclass
class Emulator:
    """A running emulator: where it listens and its live state, plus sync shortcuts for tests."""

    url: str
    host: str
    port: int
    state: EmulatorState
    app: web.Application

    def notice(self, cloud: str, kind: str, in_seconds: Optional[float] = None, **kw: Any) -> NoticeRecord:
        """Same as ``POST /_emulator/notice`` (call from the event loop thread)."""
        return self.state.add_notice(cloud, kind, in_seconds, **kw)

    def cancel(self, cloud: Optional[str] = None, notice_id: Optional[str] = None, state: str = "canceled") -> list[str]:
        return self.state.cancel(cloud, notice_id, state)

    def fault(self, mode: str, **kw: Any) -> Fault:
        return self.state.add_fault(mode, **kw)

    def configure(self, **values: Any) -> None:
        self.state.config.update(values)

    def reset(self) -> None:
        self.state.reset()


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    for address in runner.addresses:  # the real port when port=0
        if isinstance(address, tuple) and len(address) >= 2:
            bound = int(address[1])
            break
    return runner, bound


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def running_emulator(port: int = 0, host: str = "127.0.0.1", **config: Any) -> AsyncIterator[Emulator]:
    """Start an emulator in this event loop (``port=0``: a free port), stop it on exit."""
    cfg = EmulatorConfig()
    cfg.update(config)
    app = create_app(cfg)
    runner, bound = await _start(app, host, port)
    try:
        yield Emulator(url=_url(host, bound), host=host, port=bound, state=app[STATE_KEY], app=app)
    finally:
        await runner.cleanup()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    parser.add_argument("--port", type=int, default=8999, help="port (default 8999; 0 = a free port)")
    parser.add_argument("--azure-vm-name", default=EmulatorConfig.azure_vm_name, help="Azure compute name (default vm-0)")
    parser.add_argument("--asg", action="store_true", help="AWS: instance is in an Auto Scaling group")
    parser.add_argument("--aws-imdsv1", action="store_true", help="AWS: serve GETs without a token (IMDSv1)")
    parser.add_argument("--aws-recompute-time", action="store_true",
                        help="AWS: recompute the spot notice's time on every request (now + its length, whole "
                             "seconds), as amazon-ec2-metadata-mock does")
    parser.add_argument("--aws-rebalance-lead", type=float, default=0.0, metavar="SECONDS",
                        help="AWS: precede each spot notice by a rebalance recommendation this long (0 = off)")
    parser.add_argument("--log-format", choices=("json", "console"), default="json", help="stderr log format")


async def serve(args: argparse.Namespace, stop: Optional[asyncio.Event] = None) -> int:
    """Bind, announce, serve until ``stop`` (SIGTERM/SIGINT in the CLI), shut down."""
    if args.aws_rebalance_lead < 0:
        print("spotguard emulate: --aws-rebalance-lead must be >= 0", file=sys.stderr)
        return 2
    cfg = EmulatorConfig(azure_vm_name=args.azure_vm_name, asg=args.asg, aws_imdsv1=args.aws_imdsv1,
                         aws_recompute_time=args.aws_recompute_time, aws_rebalance_lead=args.aws_rebalance_lead)
    app = create_app(cfg)
    try:
        runner, bound = await _start(app, args.host, args.port)
    except OSError as exc:
        log.error("bind_failed", host=args.host, port=args.port, error=str(exc))
        return 1
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    url = _url(args.host, bound)
    sys.stdout.write(json.dumps({"event": "listening", "url": url, "host": args.host, "port": bound}) + "\n")
    sys.stdout.flush()
    log.info("listening", url=url, azure_vm_name=cfg.azure_vm_name)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    return 0


def main(args: argparse.Namespace) -> int:
    """CLI entry: exit 0 after SIGTERM/SIGINT, 1 if the port cannot be bound."""
    configure_logging(getattr(args, "log_format", "json"))
    return asyncio.run(serve(args))


def _standalone(argv: Optional[list[str]] = None) -> int:
    """``python -m spotguard.emulator.server``: the emulator without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="spotguard emulate", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
