"""Launch real torchft replica groups on one machine: the lighthouse, one process (or torchrun) per group,
each with its own spotguard daemon; shared by tests/torchft, benchmarks/bench_torchft.py and ``spotguard demo
--engine torchft``. Each group runs ``python -m spotguard.torchft.worker`` and prints JSON lines read here."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["Lighthouse", "Group", "ReplicaJob", "start_lighthouse", "start_group", "drill", "lighthouse_binary"]

def lighthouse_binary() -> Optional[str]:
    """The ``torchft_lighthouse`` console script next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Lighthouse:
    proc: subprocess.Popen[Any]
    addr: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_lighthouse(flags: list[str], log_path: Optional[Path] = None, timeout: float = 60.0) -> Lighthouse:
    """Start the Rust lighthouse on a free loopback port; returns once it accepts connections.

    The bound is generous: torchft's console script imports torch before the lighthouse binds (11.5 s measured
    on a loaded 2-core box; 20 s ran out twice there)."""
    exe = lighthouse_binary()
    if exe is None:
        raise RuntimeError("torchft_lighthouse not found: install torchft-nightly (make test installs it)")
    port = _free_port()
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([exe, "--bind", f"127.0.0.1:{port}", *flags], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return Lighthouse(proc, f"http://127.0.0.1:{port}")
        except OSError:
            time.sleep(0.02)  # waiting for a child to bind: nothing to await
    proc.kill()
    raise RuntimeError("torchft_lighthouse did not listen in time")


@dataclass
class Group:
    """One replica group's process and the JSON events it printed (read by a thread)."""

    name: str
    proc: subprocess.Popen[str]
    events: "queue.Queue[Optional[dict[str, Any]]]" = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def wait_for(self, pred: Any, timeout: float) -> Optional[dict[str, Any]]:
        """The first event (from now on) that matches ``pred``; None at timeout or process end."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev is None:
                return None
            if pred(ev):
                return ev

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("event") == "replica_step" and e.get("committed")]

    def release(self) -> None:
        """Let a group started with ``hold=True`` join the lighthouse now (it has imported everything)."""
        assert self.proc.stdin is not None, "release() is for groups started with hold=True"
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _reader(g: Group, log: Any) -> None:
    assert g.proc.stdout is not None
    for raw in iter(g.proc.stdout.readline, ""):
        if log is not None:
            log.write(raw)
            log.flush()
        brace = raw.find("{")
        if brace < 0:
            continue
        try:
            ev = json.loads(raw[brace:])
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict):
            ev["_seen"] = time.time()
            g.seen.append(ev)
            g.events.put(ev)
    g.events.put(None)


def start_group(name: str, lighthouse: str, socket_path: str, storage: str, *, steps: int,
                step_time: float, log_path: Optional[Path] = None, pg_timeout: float = 10.0,
                env: Optional[dict[str, str]] = None, hold: bool = False, end_with: int = 0,
                procs: int = 1) -> Group:
    """One replica group's process (``procs`` > 1: a ``torchrun`` of that many); with ``hold`` it imports and
    waits for ``Group.release()`` (a warm spare)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                "--max-restarts", "0", "-m"] if procs > 1 else [sys.executable, "-m"]
    cmd = [*launcher, "spotguard.torchft.worker", "--replica-id", name, "--lighthouse", lighthouse,
           "--socket", socket_path, "--storage", storage, "--steps", str(steps), "--step-time", str(step_time),
           "--pg-timeout", str(pg_timeout), *(["--hold"] if hold else []),
           *(["--end-with", str(end_with)] if end_with else [])]
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
         "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                            stdin=subprocess.PIPE if hold else subprocess.DEVNULL)
    g = Group(name, proc)
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed with the reader thread's end
    threading.Thread(target=_reader, args=(g, log), daemon=True, name=f"ftgroup-{name}").start()
    return g


def drill(socket_path: str, deadline_in: float = 30.0) -> str:
    """Ask one group's daemon for a synthetic preemption notice; returns its id."""
    from ..daemon.client import request_sync  # noqa: PLC0415
    from ..protocol import Drill, DrillOk  # noqa: PLC0415

    reply = request_sync(socket_path, Drill(kind="preemption", deadline_in=deadline_in), timeout=5.0)
    if not isinstance(reply, DrillOk):
        raise RuntimeError(f"drill refused on {socket_path}: {reply}")
    return reply.id


class ReplicaJob:
    """A lighthouse and replica groups, each with its own spotguard daemon on its own socket.

    Used as a context manager by the tests, the benchmark and the demo; stops
    everything it started at the end. A replacement group gets a fresh daemon
    (the old one would replay the notice its predecessor left for).
    """

    def __init__(self, work: Path, *, groups: int, step_time: float, steps: int,
                 lighthouse_flags: Optional[list[str]] = None, end_with: int = 0, procs: int = 1) -> None:
        from .engine import lighthouse_args  # noqa: PLC0415

        self.work = Path(work)
        self.step_time = step_time
        self.total = steps
        self.end_with = end_with  # groups go on past ``steps`` until a committed step had this many replicas
        self.procs = procs  # processes per group (torchrun when > 1)
        flags = lighthouse_args(groups=groups, step_seconds=step_time) if lighthouse_flags is None else lighthouse_flags
        self.lh: Lighthouse = start_lighthouse(flags, self.work / "lighthouse.log")
        self.daemons: dict[str, Any] = {}
        self.groups: dict[str, Group] = {}

    def __enter__(self) -> "ReplicaJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def group(self, name: str, *, hold: bool = False) -> Group:
        """Start a group with its own daemon; ``hold=True``: a warm spare that joins at ``Group.release()``."""
        from ..launch import start_daemon  # noqa: PLC0415

        sock = str(self.work / f"{name}.sock")
        self.daemons[name] = start_daemon(sock, log_path=self.work / f"{name}-daemon.log")
        g = start_group(name, self.lh.addr, sock, str(self.work / "ckpt"), steps=self.total,
                        step_time=self.step_time, log_path=self.work / f"{name}.log", hold=hold,
                        end_with=self.end_with, procs=self.procs)
        self.groups[name] = g
        return g

    def notice(self, name: str, deadline_in: float = 30.0) -> str:
        return drill(self.daemons[name].socket, deadline_in)

    def drop_daemon(self, name: str) -> None:
        d = self.daemons.pop(name, None)
        if d is not None:
            d.stop()

    def stop(self) -> None:
        for g in self.groups.values():
            if g.proc.poll() is None:
                g.proc.kill()
                g.proc.wait()
        for name in list(self.daemons):
            self.drop_daemon(name)
        self.lh.stop()
