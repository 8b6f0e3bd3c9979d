"""``spotguard status --live``: the liveness probe — is the daemon serving its socket?

Why a separate, stdlib-only module: an exec probe starts a fresh interpreter every
period, on every node, inside the daemon's memory limit. ``status --check`` imports
asyncio, ssl and the protocol (about 24 MB RSS); this imports ``socket`` and ``json``
(about 12 MB), and it answers a different question:

* liveness (restart the daemon?) = the event loop accepts a connection on the socket and
  sends its ``hello`` (or, at its connection limit, its one-line refusal) within the timeout. A blind metadata watcher is *not* a reason to
  restart: the watcher retries on its own, and a restart loop ends in CrashLoopBackOff with
  no daemon at all (and every restart replays the active notices).
* readiness and alerts (is the node protected?) = ``status --check`` / ``/healthz``: the
  socket is served *and* every metadata watcher sees notices.

Exit 0: alive; 1: not (one line on stderr naming the socket and the fix).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Optional, Sequence

__all__ = ["live", "main"]

#: The protocol's default socket (``spotguard.protocol.DEFAULT_SOCKET``; a test keeps the two equal).
DEFAULT_SOCKET = "/run/spotguard/spotguard.sock"
MAX_HELLO = 64 * 1024


def live(path: str, timeout: float = 5.0) -> Optional[str]:
    """``None`` if the daemon on ``path`` sent its ``hello`` within ``timeout``; else why not."""
    end = time.monotonic() + timeout
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            return f"cannot connect to {path} ({exc.strerror or exc})"
        buf = b""
        while b"\n" not in buf:
            left = end - time.monotonic()
            if left <= 0:
                return f"{path}: no hello within {timeout:g}s (the daemon accepts but does not answer)"
            s.settimeout(left)
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                return f"{path}: no hello within {timeout:g}s (the daemon accepts but does not answer)"
            except OSError as exc:
                return f"{path}: {exc.strerror or exc}"
            if not chunk:
                return f"{path}: the daemon closed the connection before its hello"
            buf += chunk
            if len(buf) > MAX_HELLO:
                return f"{path}: no hello line in the first {MAX_HELLO} bytes"
        try:
            msg = json.loads(buf.split(b"\n", 1)[0])
        except ValueError:
            return f"{path}: the first line is not JSON: not a spotguard daemon"
        # An ``error`` line ("too many connections") is the event loop answering too: alive, only full.
        if not isinstance(msg, dict) or msg.get("type") not in ("hello", "error"):
            return f"{path}: the first message is not a hello: not a spotguard daemon"
        return None
    finally:
        s.close()


def main(argv: Sequence[str]) -> int:
    """``spotguard status --live [--socket PATH] [--timeout S] [--json]`` without argparse or the package."""
    path = os.environ.get("SPOTGUARD_SOCKET") or DEFAULT_SOCKET
    timeout = 5.0
    as_json = False
    args = [a for a in argv if a not in ("status", "--live")]
    i = 0
    while i < len(args):
        a = args[i]
        key, eq, val = a.partition("=")
        if key in ("--socket", "--timeout") and not eq:
            if i + 1 >= len(args):
                print(f"spotguard status --live: {key} needs a value", file=sys.stderr)
                return 2
            val = args[i + 1]
            i += 1
        if key == "--socket":
            path = val
        elif key == "--timeout":
            try:
                timeout = float(val)
            except ValueError:
                print(f"spotguard status --live: --timeout {val!r} is not a number of seconds", file=sys.stderr)
                return 2
        elif key == "--json":
            as_json = True
        else:
            print(f"spotguard status --live: unknown option {a!r} (accepted: --socket, --timeout, --json)",
                  file=sys.stderr)
            return 2
        i += 1
    why = live(path, timeout)
    if as_json:
        print(json.dumps({"live": why is None, "problem": why}))
    elif why is None:
        print(f"ok: the daemon serves {path}")
    else:
        print(f"spotguard status --live: {why}; is the daemon running (`spotguard daemon --socket {path}`)?",
              file=sys.stderr)
    return 0 if why is None else 1


def live_main_args(args: object) -> int:
    """The same from parsed ``status`` arguments (``python -m spotguard.daemon.client status --live``)."""
    argv = ["--timeout", str(getattr(args, "timeout", 5.0))]
    if getattr(args, "socket", None):
        argv += ["--socket", str(getattr(args, "socket"))]
    if getattr(args, "json", False):
        argv.append("--json")
    return main(argv)
