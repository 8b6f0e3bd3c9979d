"""Notice -> delivered to subscribers, per cloud, against the emulator; fan-out; idle cost.

Targets (issue 2): p99 GCP <= 50 ms (hanging GET), AWS <= poll interval + 50 ms,
Azure <= 1 s + 50 ms; fan-out to 64 subscribers <= 5 ms p99; idle daemon RSS <=
50 MB and CPU <= 1% of one core over 60 s at default polling.

Each trial waits a random fraction of the poll interval before scheduling the
notice, so the poll phase is sampled uniformly instead of flattering the figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spotguard import protocol
from spotguard.launch import DaemonProc, Emulator, start_daemon, start_emulator

TRIALS = int(os.environ.get("SG_BENCH_TRIALS", "50"))
IDLE_SECONDS = float(os.environ.get("SG_BENCH_IDLE_SECONDS", "60"))
POLL = {"aws": 0.5, "azure": 1.0, "gcp": 0.0}
# Trials are spaced by a random 0..SPACING s: the poll phase is sampled uniformly, and
# GCP notices do not flap faster than the watcher's guard against ETag churn (10/s).
SPACING = {"aws": 0.5, "azure": 1.0, "gcp": 0.5}
PARTS = os.environ.get("SG_BENCH_PARTS", "gcp,aws,azure,fanout,idle").split(",")
TARGET_MS = {"gcp": 50.0, "aws": 550.0, "azure": 1050.0}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


async def _subscriber(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(path, limit=protocol.MAX_LINE + 1)
    hello = protocol.decode(await reader.readline(), from_daemon=True)
    assert isinstance(hello, protocol.Hello), hello
    writer.write(protocol.encode(protocol.Subscribe(pid=os.getpid(), job="bench")))
    await writer.drain()
    return reader, writer


async def _next(reader: asyncio.StreamReader, kinds: tuple[type, ...], timeout: float) -> Any:
    end = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(reader.readline(), max(0.001, end - time.monotonic()))
        if not line:
            raise ConnectionError("daemon closed the connection")
        msg = protocol.decode(line, from_daemon=True)
        if isinstance(msg, kinds):
            return msg


async def _cloud_trials(cloud: str, emu: Emulator, sock: str) -> list[float]:
    reader, writer = await _subscriber(sock)
    lat: list[float] = []
    loop = asyncio.get_running_loop()
    for _ in range(TRIALS):
        await asyncio.sleep(random.uniform(0, SPACING[cloud]) + 0.05)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, lambda: emu.notice(cloud, "preemption", in_seconds=120))
        await _next(reader, (protocol.NoticeMsg,), timeout=10)
        lat.append((time.perf_counter() - t0) * 1000)
        await loop.run_in_executor(None, lambda: emu.control("cancel", {"cloud": cloud}))
        try:  # GCP and Azure report the withdrawal; AWS spot notices simply vanish
            await _next(reader, (protocol.CancelMsg,), timeout=POLL[cloud] * 2 + 0.5)
        except asyncio.TimeoutError:
            pass
    writer.close()
    return lat


async def _fanout(sock: str, n: int = 64) -> list[float]:
    subs = [await _subscriber(sock) for _ in range(n)]
    lat: list[float] = []
    ctl_r, ctl_w = await asyncio.open_unix_connection(sock, limit=protocol.MAX_LINE + 1)
    await ctl_r.readline()
    for _ in range(TRIALS):
        t0 = time.perf_counter()
        ctl_w.write(protocol.encode(protocol.Drill(kind="rebalance", deadline_in=600)))
        await ctl_w.drain()
        await asyncio.gather(*(_next(r, (protocol.NoticeMsg,), timeout=5) for r, _ in subs))
        lat.append((time.perf_counter() - t0) * 1000)
        await _next(ctl_r, (protocol.DrillOk,), timeout=5)
    for _, w in subs:
        w.close()
    ctl_w.close()
    return lat


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _daemon_fanout_ms(log_path: Path) -> list[float]:
    """``latency_ms_max`` of each drill's ``notice.delivered`` line (all 64 written)."""
    out = []
    for line in log_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "notice.delivered" and rec.get("source") == "drill" and rec.get("subscribers") == 64:
            out.append(float(rec["latency_ms_max"]))
    return out


def _summary(lat: list[float]) -> dict[str, float]:
    return {
        "trials": len(lat),
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(pct(lat, 0.99), 2),
        "max_ms": round(max(lat), 2),
    }


def run() -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="sgb-", dir="/tmp")
    results: dict[str, Any] = {"trials_per_cloud": TRIALS}
    emu = start_emulator()
    try:
        for cloud in [c for c in ("gcp", "aws", "azure") if c in PARTS]:
            emu.reset()
            d = start_daemon(f"{tmp}/{cloud}.sock", cloud=cloud, metadata_url=emu.url)
            try:
                lat = asyncio.run(_cloud_trials(cloud, emu, d.socket))
            finally:
                d.stop()
            s = _summary(lat)
            s["target_p99_ms"] = TARGET_MS[cloud]
            s["meets_target"] = s["p99_ms"] <= TARGET_MS[cloud]
            results[cloud] = s
        if "fanout" in PARTS:
            log_path = Path(tmp) / "fan.log"
            d = start_daemon(f"{tmp}/fan.sock", cloud="none", log_path=log_path)
            try:
                s = _summary(asyncio.run(_fanout(d.socket)))
            finally:
                d.stop()
            # Client-observed: drill sent -> the 64th of 64 readers, all in this one Python
            # process (their own decoding counts). Daemon-side: notice received -> written
            # to the last of the 64 sockets, from its own "notice.delivered" log lines.
            s["measured"] = "client: drill request -> decoded by all 64 readers in one process"
            daemon_side = _daemon_fanout_ms(log_path)
            s["daemon_side"] = {**_summary(daemon_side), "measured": "daemon: received -> written to all 64 sockets"}
            s["subscribers"] = 64
            s["target_p99_ms"] = 5.0
            s["meets_target"] = s["daemon_side"]["p99_ms"] <= 5.0
            results["fanout_64"] = s
        if "idle" not in PARTS:
            return results

        # Idle cost: all three daemons at default polling, side by side, same window.
        emu.reset()
        daemons: dict[str, DaemonProc] = {
            c: start_daemon(f"{tmp}/idle-{c}.sock", cloud=c, metadata_url=emu.url) for c in ("aws", "gcp", "azure")
        }
        try:
            time.sleep(2.0)  # let start-up allocations settle before the window opens
            cpu0 = {c: _proc_cpu_seconds(d.proc.pid) for c, d in daemons.items()}
            t0 = time.monotonic()
            time.sleep(IDLE_SECONDS)  # the measurement window itself
            wall = time.monotonic() - t0
            idle = {}
            for c, d in daemons.items():
                cpu_pct = (_proc_cpu_seconds(d.proc.pid) - cpu0[c]) / wall * 100
                rss = _proc_rss_mb(d.proc.pid)
                idle[c] = {
                    "cpu_percent_of_core": round(cpu_pct, 3),
                    "rss_mb": round(rss, 1),
                    "meets_target": cpu_pct <= 1.0 and rss <= 50.0,
                }
            idle["window_seconds"] = round(wall, 1)
            results["idle"] = idle
        finally:
            for d in daemons.values():
                d.stop()
    finally:
        emu.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
