"""What the 2-rank torchrun benchmarks share: launching the job, its result line, simulated compute.

A benchmark module runs twice: ``run()`` in the caller's process starts
``torchrun`` on the module's own file with ``--worker``; the workers measure and
rank 0 prints one ``BENCH_RESULT <json>`` line, which ``run()`` returns. The
job gets the repository on ``PYTHONPATH`` so the workers import this module too.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["busy", "cpu_seconds", "free_port", "wait_port", "json_lines", "log_time", "print_result", "run_torchrun", "main"]

RESULT_PREFIX = "BENCH_RESULT "
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on loopback (for servers the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, tries: int = 100) -> None:
    """Until a server the benchmark started accepts on ``port`` (at most ``tries`` × ~0.1 s)."""
    for _ in range(tries):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)  # a child server's port: nothing to await but a connection


def cpu_seconds() -> float:
    """This process's CPU time, every thread, user + system."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def busy(seconds: float) -> None:
    """Simulated compute: sleep most of it, spin the rest (sleep alone jitters by ~100 us)."""
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.002)
    while time.perf_counter() < end:
        pass


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects in a job's output, one per line, each read from its line's first ``{`` (the hook's lines,
    whatever the launcher put before them); other lines are skipped."""
    out = []
    for raw in text.splitlines():
        i = raw.find("{")
        if i < 0:
            continue
        try:
            obj = json.loads(raw[i:])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def log_time(event: dict[str, Any]) -> float:
    """A log line's ``timestamp`` (RFC 3339, UTC) as seconds since the epoch."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def print_result(result: dict[str, Any]) -> None:
    """Rank 0's answer to ``run_torchrun``."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_torchrun(script: str, *, timeout: float, env: Mapping[str, str] = {}) -> dict[str, Any]:
    """Run ``script --worker`` on 2 ranks (``torchrun --standalone``, one thread each) and return
    the ``BENCH_RESULT`` it printed; raise with the job's output tails when it printed none."""
    torchrun = Path(sys.executable).parent / "torchrun"
    job_env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTGUARD_LOG_LEVEL": "warning", **env,
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(Path(script).resolve()), "--worker"],
        capture_output=True, text=True, env=job_env, timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    raise RuntimeError(f"benchmark job failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def main(run: Callable[[], dict[str, Any]], worker: Callable[[], None]) -> None:
    """A benchmark module's ``__main__``: the worker under torchrun, else the whole benchmark."""
    if "--worker" in sys.argv:
        worker()
    else:
        print(json.dumps(run(), indent=2))
