"""Real ``spotguard daemon`` processes for the hook's end-to-end tests (drill, status, restart)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from spotguard.launch import DaemonProc, query_status, start_daemon

from ._torchrun import TorchRun

RANK_SOCKET_LAUNCHER = Path(__file__).resolve().parent / "_rank_socket_train.py"


class ScriptRun(TorchRun):
    """``TorchRun`` (e.g. of the per-rank socket launcher) that also reads the notice intake's lines."""

    def intake_lines(self, rank: Optional[int] = None) -> list[dict[str, Any]]:
        """The notice intake's own log lines (they carry no ``component``)."""
        return [e for e in self.lines() if e.get("logger") == "spotguard.hook.intake"
                and (rank is None or e.get("rank") == rank)]


def wait_until(pred: Callable[[], Any], timeout: float, what: str, run: Optional[TorchRun] = None) -> Any:
    """Poll ``pred`` (a status query, a log read: nothing to await) until truthy; its value."""
    end = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while time.monotonic() < end:
        try:
            val = pred()
        except OSError as exc:  # the daemon is (re)starting
            last_exc, val = exc, None
        if val:
            return val
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"torchrun exited ({run.proc.returncode}) before {what}:\n{run.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_exc!r})"
                         + (f":\n{run.tail()}" if run is not None else ""))


def subscribers(sock: str) -> list[dict[str, Any]]:
    return list(query_status(sock)["subscribers"])


def wait_subscribed(sock: str, ranks: set[int], run: Optional[TorchRun] = None, timeout: float = 120.0) -> None:
    """Until the daemon on ``sock`` lists exactly these ranks as subscribers (a readiness wait: it returns as soon
    as they are, fails at once if torchrun exits; 120 s covers a two-rank start on two loaded cores, measured
    24-33 s to ``hook_installed`` at load 12)."""
    wait_until(lambda: {s.get("rank") for s in subscribers(sock)} == ranks, timeout,
               f"ranks {sorted(ranks)} subscribed to {sock}", run)


def drill(sock: str, kind: str = "preemption", deadline_in: float = 30.0) -> str:
    """``spotguard drill`` through the real CLI; returns the notice id."""
    out = subprocess.run(
        [sys.executable, "-m", "spotguard", "drill", "--socket", sock, "--kind", kind,
         "--deadline-in", str(deadline_in), "--json"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, f"spotguard drill failed ({out.returncode}): {out.stderr}"
    return str(json.loads(out.stdout)["id"])


def status_cli(sock: str) -> dict[str, Any]:
    """``spotguard status --json`` through the real CLI."""
    out = subprocess.run([sys.executable, "-m", "spotguard", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"spotguard status failed ({out.returncode}): {out.stderr}"
    return dict(json.loads(out.stdout))


def active_notice(state: dict[str, Any], notice_id: str) -> dict[str, Any]:
    found = [n for n in state["active_notices"] if n["id"] == notice_id]
    assert found, f"notice {notice_id} not active in the daemon: {state['active_notices']}"
    return dict(found[0])


@contextmanager
def running_daemon(sock: Path, log: Path) -> Iterator[DaemonProc]:
    d = start_daemon(str(sock), cloud="none", log_path=log)
    try:
        yield d
    finally:
        d.stop()
