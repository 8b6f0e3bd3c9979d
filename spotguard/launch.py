"""Start the emulator and the daemon as real subprocesses (demo, benchmarks, end-to-end tests).

Each helper waits for a real readiness signal — the emulator's "listening" line,
the daemon answering ``status`` on its socket — never for a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Sequence

from . import protocol

__all__ = ["Emulator", "DaemonProc", "start_emulator", "start_daemon", "query_status", "post_json"]


def _cli() -> list[str]:
    return [sys.executable, "-m", "spotguard"]


def post_json(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
        raw = resp.read()
    return json.loads(raw) if raw else None


def _stop(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass
class Emulator:
    proc: subprocess.Popen[Any]
    url: str

    def notice(self, cloud: str, kind: str = "preemption", in_seconds: float = 120, **extra: Any) -> Any:
        return post_json(f"{self.url}/_emulator/notice", {"cloud": cloud, "kind": kind, "in_seconds": in_seconds, **extra})

    def reset(self) -> Any:
        return post_json(f"{self.url}/_emulator/reset")

    def control(self, name: str, body: dict[str, Any] | None = None) -> Any:
        return post_json(f"{self.url}/_emulator/{name}", body)

    def stop(self) -> int:
        return _stop(self.proc)


def start_emulator(*, port: int = 0, extra_args: Sequence[str] = (), stderr: Optional[IO[Any]] = None,
                   timeout: float = 20.0) -> Emulator:
    proc = subprocess.Popen(
        [*_cli(), "emulate", "--port", str(port), *extra_args],
        stdout=subprocess.PIPE, stderr=stderr if stderr is not None else subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("event") == "listening":
            return Emulator(proc=proc, url=str(msg["url"]).rstrip("/"))
    _stop(proc)
    raise RuntimeError(f"spotguard emulate did not report listening (exit code {proc.returncode})")


def query_status(socket_path: str, timeout: float = 2.0) -> dict[str, Any]:
    """One ``status`` round trip over the socket (blocking; for scripts)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        f = s.makefile("rb")
        hello = protocol.decode(f.readline(protocol.MAX_LINE + 1), from_daemon=True)
        if not isinstance(hello, protocol.Hello):
            raise RuntimeError(f"expected hello, got {hello!r}")
        s.sendall(protocol.encode(protocol.StatusRequest()))
        while True:
            msg = protocol.decode(f.readline(protocol.MAX_LINE + 1), from_daemon=True)
            if isinstance(msg, protocol.StatusReply):
                return msg.state
            if isinstance(msg, protocol.ErrorReply):
                raise RuntimeError(msg.error)


@dataclass
class DaemonProc:
    proc: subprocess.Popen[Any]
    socket: str
    log_path: Optional[Path] = None
    args: list[str] = field(default_factory=list)

    def stop(self) -> int:
        return _stop(self.proc)


def start_daemon(socket_path: str, *, cloud: str = "none", metadata_url: Optional[str] = None,
                 extra_args: Sequence[str] = (), log_path: Optional[Path] = None,
                 env: Optional[dict[str, str]] = None, timeout: float = 20.0) -> DaemonProc:
    args = [*_cli(), "daemon", "--cloud", cloud, "--socket", socket_path, "--log-format", "json", *extra_args]
    if metadata_url:
        args += ["--metadata-url", metadata_url]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if log_path:
        log.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"spotguard daemon exited with code {proc.returncode} (log: {log_path})")
        if os.path.exists(socket_path):
            try:
                query_status(socket_path, timeout=1.0)
                return DaemonProc(proc=proc, socket=socket_path, log_path=log_path, args=args)
            except OSError:
                pass
        time.sleep(0.02)  # waiting for a child process to bind: nothing to await
    _stop(proc)
    raise RuntimeError(f"spotguard daemon did not answer on {socket_path} within {timeout} s")
