"""``spotguard wait-checkpoint``: block until every local trainer reported its checkpoint.

Termination ordering on a node being reclaimed: Kubernetes runs a container's
``preStop`` hook *before* its SIGTERM, and systemd runs ``ExecStop=`` before it
signals the unit. Used there, this command holds the SIGTERM (and the grace
countdown that ends in SIGKILL) back until every subscriber of the local daemon
reported ``checkpoint_done`` / ``checkpoint_failed`` for the active emergency
notice, or left. With no emergency notice active it returns at once, so an
ordinary pod deletion or ``systemctl stop`` is not delayed; a far notice (more
than 5 minutes out: a GCP GPU maintenance window) is waited for only once a
trainer has started its checkpoint, since the hook keeps training until then.

Exit codes: 0 every subscriber reported (or none was waited for), 1 the daemon
cannot be reached, 3 ``--timeout`` passed with subscribers still writing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Optional

from ..protocol import DEFAULT_SOCKET, ErrorReply, StatusReply, StatusRequest
from .client import DaemonUnavailable, default_socket_path, request

__all__ = ["add_arguments", "main", "wait_checkpoint", "EXIT_TIMEOUT"]

EXIT_TIMEOUT = 3
POLL = 0.2


async def wait_checkpoint(path: str, timeout: float, poll: float = POLL) -> tuple[bool, dict[str, Any]]:
    """(done, last ``checkpoint_pending``); ``DaemonUnavailable`` when no daemon answers."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        left = end - loop.time()
        reply = await request(path, StatusRequest(), timeout=max(1.0, min(5.0, left)))
        if isinstance(reply, ErrorReply) or not isinstance(reply, StatusReply):
            raise DaemonUnavailable(f"the daemon on {path} refused status: {getattr(reply, 'error', reply)}")
        pending = reply.state.get("checkpoint_pending") or {"count": 0, "notices": [], "subscribers": []}
        if not pending.get("count"):
            return True, pending
        if loop.time() + poll > end:
            return False, pending
        await asyncio.sleep(poll)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help=f"daemon socket (default: $SPOTGUARD_SOCKET or {DEFAULT_SOCKET})")
    parser.add_argument("--timeout", type=float, default=25.0, metavar="SECONDS",
                        help="give up after this long (default 25; keep it below the pod's "
                             "terminationGracePeriodSeconds / the unit's TimeoutStopSec)")


def main(args: argparse.Namespace) -> int:
    path = args.socket or default_socket_path()
    if not args.timeout > 0:
        print("spotguard wait-checkpoint: --timeout must be greater than 0", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        done, pending = asyncio.run(wait_checkpoint(path, args.timeout))
    except DaemonUnavailable as exc:
        print(f"spotguard wait-checkpoint: {exc}", file=sys.stderr)
        return 1
    took = time.monotonic() - t0
    notices = ", ".join(pending.get("notices") or []) or "none"
    if done:
        print(f"spotguard wait-checkpoint: done after {took:.1f}s (active emergency notices: {notices})")
        return 0
    late = [f"pid {s.get('pid', '?')} rank {s.get('rank', '?')}" for s in pending.get("subscribers") or []]
    print(f"spotguard wait-checkpoint: timed out after {took:.1f}s; {pending.get('count')} subscriber(s) have not "
          f"reported for {notices}: {', '.join(late)}", file=sys.stderr)
    return EXIT_TIMEOUT


def _standalone(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="spotguard wait-checkpoint")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
