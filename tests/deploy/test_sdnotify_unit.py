"""End to end: start `spotguard daemon` the way systemd/spotguard.service does (its
ExecStart and Environment=), with NOTIFY_SOCKET pointing at a datagram socket the
test reads and WATCHDOG_USEC/WATCHDOG_PID set, and check READY=1 (only once the
socket answers), WATCHDOG=1 pings and STOPPING=1 on SIGTERM; also that the idle
footprint fits the Kubernetes memory request.

Differences from the real unit, each forced by the test machine: --cloud none
(no metadata server may be contacted from here), the socket in a temp directory,
the socket group = the test's own group, WATCHDOG_USEC of 1 s instead of 30 s.
"""

from __future__ import annotations

import grp
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import REPO, load_yaml_docs, run
from .test_systemd import UNIT, env, one, parse_unit

WATCHDOG_USEC = 1_000_000


def _spotguard() -> str:
    exe = Path(sys.executable).parent / "spotguard"
    return str(exe) if exe.exists() else ""


def unit_command(sock: Path) -> tuple[list[str], dict[str, str]]:
    u = parse_unit(UNIT)
    argv = shlex.split(one(u, "Service", "ExecStart"))
    assert argv[0].endswith("/spotguard") and argv[1] == "daemon"
    args = argv[2:]
    if "--cloud" in args:
        args[args.index("--cloud") + 1] = "none"
    else:
        args += ["--cloud", "none"]
    if "--socket" in args:
        args[args.index("--socket") + 1] = str(sock)
    else:
        args += ["--socket", str(sock)]
    e = env(u)
    e["SPOTGUARD_CLOUD"] = "none"  # never probe a metadata address from here, flag or not
    e["SPOTGUARD_SOCKET"] = str(sock)
    e["SPOTGUARD_SOCKET_GROUP"] = grp.getgrgid(os.getgid()).gr_name
    e.pop("SPOTGUARD_METADATA_URL", None)
    return [_spotguard() or "spotguard", "daemon", *args], e


class NotifyListener:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def recv(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append((time.monotonic(), fields))
        return fields

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg and key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout}s; got {[m for _, m in self.messages]}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def unit_daemon(short_tmp: Path) -> Iterator[tuple[subprocess.Popen[str], NotifyListener, Path]]:
    if not _spotguard():
        pytest.skip("spotguard console script not installed in this venv (`make setup`)")
    listener = NotifyListener(short_tmp / "notify")
    sock = short_tmp / "run" / "spotguard.sock"
    sock.parent.mkdir(mode=0o750)          # RuntimeDirectory=spotguard, RuntimeDirectoryMode=0750
    argv, unit_env = unit_command(sock)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    full_env.update(unit_env, NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC=str(WATCHDOG_USEC))
    # systemd sets WATCHDOG_PID to the main PID: exec keeps the shell's PID.
    shell = 'export WATCHDOG_PID=$$; exec "$@"'
    proc = subprocess.Popen(["sh", "-c", shell, "sh", *argv], env=full_env, cwd=short_tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, listener, sock
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        listener.close()


@pytest.mark.serial
def test_ready_watchdog_stopping(unit_daemon: tuple[subprocess.Popen[str], NotifyListener, Path]) -> None:
    proc, listener, sock = unit_daemon
    ready = listener.wait_for("READY", timeout=30)
    assert ready["READY"] == "1"
    assert ready.get("MAINPID", str(proc.pid)) == str(proc.pid)
    # Type=notify promise: the socket already listens when READY=1 is sent.
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    status = run([str(Path(sys.executable).parent / "spotguard"), "status", "--socket", str(sock), "--timeout", "5"], check=False)
    assert status.returncode == 0, status.stdout + status.stderr
    # WATCHDOG=1 at least every WATCHDOG_USEC/2 (systemd's advice), so >= 2 within 1.5 s.
    t0 = time.monotonic()
    pings = 0
    while pings < 3 and time.monotonic() - t0 < 5:
        msg = listener.recv(timeout=5)
        if msg and msg.get("WATCHDOG") == "1":
            pings += 1
    elapsed = time.monotonic() - t0
    assert pings >= 3, f"only {pings} WATCHDOG=1 in {elapsed:.1f}s"
    assert elapsed < 3 * WATCHDOG_USEC / 1e6, f"watchdog pings too slow: 3 in {elapsed:.1f}s"
    # Stop as systemd does: SIGTERM, then STOPPING=1 and a clean exit within TimeoutStopSec.
    proc.send_signal(signal.SIGTERM)
    listener.wait_for("STOPPING", timeout=10)
    timeout_stop = float(one(parse_unit(UNIT), "Service", "TimeoutStopSec").rstrip("s"))
    assert proc.wait(timeout=timeout_stop) == 0, proc.stderr.read() if proc.stderr else ""


def test_idle_footprint_fits_kubernetes_requests(unit_daemon: tuple[subprocess.Popen[str], NotifyListener, Path]) -> None:
    proc, listener, _ = unit_daemon
    listener.wait_for("READY", timeout=30)
    t0, cpu0 = time.monotonic(), _cpu_seconds(proc.pid)
    time.sleep(3)
    cpu = (_cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
    rss_mib = _vmrss_kib(proc.pid) / 1024
    (job,) = load_yaml_docs((REPO / "deploy/kubernetes/sidecar/job.yaml").read_text())
    sidecar = next(c for c in job["spec"]["template"]["spec"]["initContainers"] if c["name"] == "spotguard")
    request = int(sidecar["resources"]["requests"]["memory"].removesuffix("Mi"))
    print(f"idle spotguard daemon: VmRSS {rss_mib:.1f} MiB, CPU {cpu * 100:.2f} % (request {request} Mi)")
    assert rss_mib < request, f"VmRSS {rss_mib:.1f} MiB exceeds the sidecar's memory request {request}Mi"
    assert cpu < 0.05, f"idle CPU {cpu * 100:.1f} % of a core"


def _vmrss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
