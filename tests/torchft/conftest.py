"""Single-process replica groups (``ReplicaJob``) forked from one server that imported torch and torchft.

Each group is otherwise a fresh ``python -m spotguard.torchft.worker``, whose CPU before its first step is mostly
``import torch``, ``torch.distributed.checkpoint`` and ``torchft`` (~3 CPU-seconds on 2 cores; test_replicas starts
nine). The server is tests/exactness/_zygote.py (never imports ``spotguard``: the worktree's, on ``PYTHONPATH``,
is what the child imports); each child is in its own session, its stdout/stderr into a FIFO that
``spotguard.torchft.launch``'s own reader reads, its exit code reported as ``Popen`` would (``os._exit(143)``
-> 143). What differs from a fresh process is what _zygote.py says (hash seed, ``OMP_NUM_THREADS=1`` at the
torch import, for every group alike). Groups started with ``hold=True`` (a stdin to release them) and torchrun
groups (``procs`` > 1) are started as before. Every lighthouse is the same Rust ``lighthouse_main`` without the
torch import that its console script pays (_lighthouse.py). ``SPOTGUARD_FT_FORK=0`` turns both off.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from spotguard.torchft import launch
from tests.exactness.oracle import _Forked, _Zygote

_SERVER: list[_Zygote] = []
_FORKED: list[int] = []  # the pids it forked for us
_LOCK = threading.Lock()
_ORIGINAL = launch.start_group


class _GroupProc:
    """The part of ``subprocess.Popen`` that ``launch.Group`` and the tests use, for a forked group."""

    def __init__(self, forked: _Forked) -> None:
        self._forked = forked
        self.pid = forked.pid
        self.stdin = None
        self.stdout: Optional[Any] = None  # the FIFO, opened by the reader thread

    @property
    def returncode(self) -> Optional[int]:
        return self._forked.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._forked.wait(timeout)

    def poll(self) -> Optional[int]:
        try:
            return self._forked.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, sig)  # its own session: whatever it started goes too
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _server() -> _Zygote:
    with _LOCK:
        if not _SERVER or _SERVER[0].proc.poll() is not None:
            _SERVER[:] = [_Zygote(("torchft",))]
        return _SERVER[0]


def _forked_group(name: str, lighthouse: str, socket_path: str, storage: str, *, steps: int, step_time: float,
                  log_path: Optional[Path] = None, pg_timeout: float = 10.0, env: Optional[dict[str, str]] = None,
                  hold: bool = False, end_with: int = 0, procs: int = 1) -> launch.Group:
    """``launch.start_group`` with the process forked (same argv, environment and JSON-line reader)."""
    if hold or procs > 1:
        return _ORIGINAL(name, lighthouse, socket_path, storage, steps=steps, step_time=step_time,
                         log_path=log_path, pg_timeout=pg_timeout, env=env, hold=hold, end_with=end_with,
                         procs=procs)
    argv = [str(Path(__file__).with_name("_forked_worker.py")), "--replica-id", name, "--lighthouse", lighthouse,
            "--socket", socket_path, "--storage", storage, "--steps", str(steps), "--step-time", str(step_time),
            "--pg-timeout", str(pg_timeout), *(["--end-with", str(end_with)] if end_with else [])]
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
         "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **(env or {})}
    fifo = Path(tempfile.mkdtemp(prefix="sgft-", dir="/tmp")) / "out"
    os.mkfifo(fifo)
    proc = _GroupProc(_server().start(argv, e, os.getcwd(), fifo))
    _FORKED.append(proc.pid)
    g = launch.Group(name, proc)  # type: ignore[arg-type]  # Popen's interface, as far as Group uses it

    def read() -> None:
        log = open(log_path, "a") if log_path else None  # noqa: SIM115 - the reader's, as in launch
        with open(fifo, errors="replace") as out:  # returns once the child opened its end
            fifo.unlink()
            fifo.parent.rmdir()
            proc.stdout = out
            launch._reader(g, log)

    threading.Thread(target=read, daemon=True, name=f"ftgroup-{name}").start()
    return g


@pytest.fixture(scope="session")
def _lighthouse_script() -> Iterator[Optional[str]]:
    """_lighthouse.py as an executable behind this interpreter's ``#!`` (None: no torchft lighthouse here)."""
    if launch.lighthouse_binary() is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="sgft-lh-", dir="/tmp"))
    script = folder / "torchft_lighthouse"
    script.write_text(f"#!{sys.executable}\n" + Path(__file__).with_name("_lighthouse.py").read_text())
    script.chmod(0o755)
    yield str(script)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fork_replica_groups(monkeypatch: pytest.MonkeyPatch, _lighthouse_script: Optional[str]) -> None:
    """``ReplicaJob.group`` forks its single-process groups from the server (started on first use); every
    lighthouse starts without the torch import."""
    if os.environ.get("SPOTGUARD_FT_FORK", "1") == "0":
        return
    monkeypatch.setattr(launch, "start_group", _forked_group)
    if _lighthouse_script is not None:
        monkeypatch.setattr(launch, "lighthouse_binary", lambda: _lighthouse_script)


@pytest.fixture(scope="session", autouse=True)
def _fork_server_stops() -> Iterator[None]:
    """The fork server leaves at the session's end: EOF on its stdin (it kills what it started first), or SIGKILL
    once it reported every child's end (what is left to it then is only its interpreter's exit with torch
    loaded: ~1 CPU-second, 6 s on a loaded box)."""
    yield
    while _SERVER:
        zygote = _SERVER.pop()
        if zygote.proc.stdin is not None:
            zygote.proc.stdin.close()
        with zygote._cond:
            ended = all(pid in zygote._status for pid in _FORKED)
        if ended:
            zygote.proc.kill()
        zygote.proc.wait(30)
