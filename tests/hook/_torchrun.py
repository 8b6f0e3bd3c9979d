"""Run ``examples/torchrun_train.py`` (or another script) under a real ``torchrun`` and read its JSON lines."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def job_tmpdir(log: Path) -> Path:
    """``<log>.tmp`` beside the job's log, made: the job's ``TMPDIR``, so torchelastic's ``torchelastic_*``
    folders (and the workers' own temp files) go under the test's folder instead of piling up in /tmp."""
    tmpdir = log.parent / f"{log.stem}.tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    return tmpdir



def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc: the ranks and their loader workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out

class TorchRun:
    """One ``torchrun --standalone`` job; stdout+stderr of agent and workers go to one log file."""

    def __init__(self, log: Path, args: list[str], *, script: Path = EXAMPLE, nproc: int = 2,
                 env: Optional[dict[str, str]] = None) -> None:
        self.log = log
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(job_tmpdir(log)),
                    "SPOTGUARD_SOCKET": str(log.parent / "no-daemon.sock"), **(env or {})}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(script), *args],
                stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=str(log.parent), start_new_session=True,
            )

    def lines(self) -> list[dict[str, Any]]:
        """Every JSON object in the log, also when two workers' lines ran together on one line."""
        out: list[dict[str, Any]] = []
        dec = json.JSONDecoder()
        for raw in self.log.read_text(errors="replace").splitlines():
            i = raw.find("{")
            while 0 <= i < len(raw):
                try:
                    obj, end = dec.raw_decode(raw, i)
                except json.JSONDecodeError:
                    i = raw.find("{", i + 1)
                    continue
                if isinstance(obj, dict):
                    out.append(obj)
                i = raw.find("{", end)
        return out

    def events(self, name: Optional[str] = None, rank: Optional[int] = None) -> list[dict[str, Any]]:
        return [e for e in self.lines() if e.get("component") == "hook"
                and (name is None or e.get("event") == name) and (rank is None or e.get("rank") == rank)]

    def steps(self) -> list[int]:
        return [e["step"] for e in self.lines() if "loss" in e]

    def wait_for(self, pred: Any, timeout: float = 60.0, what: str = "condition") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return
            if self.proc.poll() is not None and not pred():
                raise AssertionError(f"torchrun exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.02)  # polling a child's log file: nothing to await
        raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")

    def wait_step(self, step: int, timeout: float = 60.0) -> None:
        self.wait_for(lambda: any(s >= step for s in self.steps()), timeout, f"step {step}")

    def pid(self, rank: int) -> int:
        self.wait_for(lambda: bool(self.events("hook_installed", rank)), 60, f"rank {rank} hook")
        return int(self.events("hook_installed", rank)[0]["pid"])

    def signal_rank(self, rank: int, sig: int) -> None:
        os.kill(self.pid(rank), sig)

    def wait(self, timeout: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"torchrun did not finish within {timeout} s:\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            # torchrun starts each worker in a session of its own: killing torchrun's group alone would leave
            # the ranks orphaned, blocked on the agent's dead c10d store (seen: 33 min after a timed-out leg)
            workers = _descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


_REFERENCES: dict[int, Path] = {}  # steps -> the first such run's --out file, this session


def reference_run(folder: Path, steps: int) -> Path:
    """The uninterrupted run of the example without spotguard (``ref.log`` in ``folder``); its ``--out`` file.

    Run once per step count a session (the same arguments give the same bytes; a torchrun job is ~7 s of a
    2-core CI's time): later callers get a copy of the first run's file, or a run of their own if it is gone."""
    out = folder / "ref.pt"
    first = _REFERENCES.get(steps)
    if first is not None and first.is_file():
        shutil.copyfile(first, out)
        return out
    run = TorchRun(folder / "ref.log", ["--steps", str(steps), "--no-hook", "--out", str(out)])
    assert run.wait() == 0, run.tail()
    _REFERENCES[steps] = out
    return out


def load_out(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None when bitwise identical, else where they differ."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            return path or "<root>"
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{path} (keys)"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{path} (length)"
        for i, (u, v) in enumerate(zip(a, b)):
            d = first_difference(u, v, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else path
