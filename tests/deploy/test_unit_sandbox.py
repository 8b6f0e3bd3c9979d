"""Does the real daemon fit inside the unit's sandbox? Without a running systemd the
sandbox cannot be applied here, so the daemon runs under strace through a busy
life — metadata polling (AWS, via the emulator), a notice, a subscriber, `status`,
`drill`, /metrics, sd_notify, SIGTERM — and every system call it made must be
allowed by the unit's SystemCallFilter=, every socket family by
RestrictAddressFamilies=, and no mapping may break MemoryDenyWriteExecute=.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest

from .conftest import require_tool, run
from .test_systemd import UNIT, one, parse_unit, values
from .test_sdnotify_unit import NotifyListener


@lru_cache(maxsize=None)
def syscall_groups() -> dict[str, list[str]]:
    sa = require_tool("systemd-analyze")
    groups: dict[str, list[str]] = {}
    current = None
    for line in run([sa, "syscall-filter", "--no-pager"]).stdout.splitlines():
        if line.startswith("@"):
            current = line.split()[0]
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.strip())
    return groups


def expand(name: str) -> set[str]:
    if not name.startswith("@"):
        return {name}
    out: set[str] = set()
    for member in syscall_groups()[name]:
        out |= expand(member)
    return out


def unit_syscall_policy() -> tuple[set[str], set[str]]:
    allowed: set[str] = set()
    denied: set[str] = set()
    for v in values(parse_unit(UNIT), "Service", "SystemCallFilter"):
        deny = v.startswith("~")
        for item in v.lstrip("~").split():
            (denied if deny else allowed).update(expand(item))
    return allowed - denied, denied


def _spotguard() -> str:
    exe = Path(sys.executable).parent / "spotguard"
    if not exe.exists():
        pytest.skip("spotguard console script not installed in this venv")
    return str(exe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_daemon_stays_inside_the_unit_sandbox(short_tmp: Path) -> None:
    strace = require_tool("strace")
    spotguard = _spotguard()
    allowed, denied = unit_syscall_policy()
    emu = subprocess.Popen([spotguard, "emulate", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    listener = NotifyListener(short_tmp / "notify")
    sock = short_tmp / "sg.sock"
    trace = short_tmp / "trace"
    daemon = None
    child = 0
    try:
        url = json.loads(emu.stdout.readline())["url"] if emu.stdout else ""
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC="1000000", SPOTGUARD_POLL_INTERVAL="0.2", SPOTGUARD_SIGTERM_GRACE="2")
        daemon = subprocess.Popen([strace, "-f", "-qq", "-s", "64", "-o", str(trace), spotguard, "daemon",
                                   "--cloud", "aws", "--metadata-url", url, "--socket", str(sock),
                                   "--metrics-port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listener.wait_for("READY", timeout=60)
        (pid,) = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children").read_text().split()
        child = int(pid)  # the daemon itself, strace's child
        # A subscriber, a real AWS notice through the watcher, status, drill, metrics.
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(sock))
        client.sendall(json.dumps({"type": "subscribe", "pid": os.getpid(), "rank": 0, "local_rank": 0,
                                   "world_size": 1, "job": "sandbox"}).encode() + b"\n")
        req = urllib.request.Request(url + "/_emulator/notice", data=json.dumps(
            {"cloud": "aws", "kind": "preemption", "in_seconds": 120}).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        client.settimeout(10)
        buf = b""
        deadline = time.monotonic() + 10
        while b'"notice"' not in buf and time.monotonic() < deadline:
            buf += client.recv(65536)
        assert b'"notice"' in buf, buf
        run([spotguard, "status", "--socket", str(sock)])
        run([spotguard, "drill", "--socket", str(sock), "--kind", "rebalance", "--deadline-in", "60"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert b"spotguard_" in resp.read()
        client.close()
        # SIGTERM to the daemon itself, as systemd would send it.
        os.kill(child, signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon and daemon.poll() is None:
            if child:  # killing strace alone would leave the traced daemon running
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            daemon.kill()
            daemon.wait()
        emu.terminate()
        emu.wait(timeout=10)
        listener.close()

    text = trace.read_text()
    used = set(re.findall(r"^\d+\s+(?:<\.\.\. )?([a-z_0-9]+)\(", text, re.M))
    used.discard("execve")  # strace's own exec of the daemon; systemd execs before the filter applies
    assert {"socket", "bind", "listen", "connect", "sendto"} <= used, f"trace not parsed: {sorted(used)[:20]}"
    outside = sorted(used - allowed)
    assert not outside, f"syscalls outside SystemCallFilter= (denied: {sorted(set(outside) & denied)}): {outside}"
    families = set(re.findall(r"\bsocket\((AF_[A-Z0-9]+)", text))
    assert families <= set(one(parse_unit(UNIT), "Service", "RestrictAddressFamilies").split()), families
    wx = re.findall(r"^.*\b(?:mmap|mprotect|pkey_mprotect)\(.*PROT_EXEC.*$", text, re.M)
    bad = [l for l in wx if "mprotect" in l or "PROT_WRITE" in l]
    assert not bad, "MemoryDenyWriteExecute would refuse:\n" + "\n".join(bad[:5])
