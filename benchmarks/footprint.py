"""Daemon memory with every cluster action on, idle and at a notice, and per exec probe (issue 24).

``python -m benchmarks.footprint`` (about 30 s). What it measures, from ``/proc/PID/status``:

* ``idle_*``: VmRSS of a ``spotguard daemon`` a few seconds after READY=1 (``--cloud aws`` polling
  ``spotguard emulate``), plain and with ``--kubernetes-node-actions --asg-lifecycle-hook auto
  --webhook-url --slack-webhook-url``;
* ``notice_peak``: VmHWM (the peak) after an ASG termination notice drove every action (the Kubernetes
  GET/PATCH, the Auto Scaling calls, both webhooks) against servers that accept and never answer, so
  each client is built and in flight;
* ``probe_live`` / ``probe_check``: the peak RSS of one ``spotguard status --live`` / ``--check``
  exec probe (a separate interpreter, ``RUSAGE_CHILDREN``).

The requests/limits in deploy/ are sized from these figures (docs/deploy.md, "Measured footprint").
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


class Mute:
    """A TCP server that accepts and never answers: every HTTP client stays in flight."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return


def _emulator() -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, "-m", "spotguard", "emulate", "--port", "0", "--asg"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready, "the emulator printed no listening line"
    return proc, json.loads(proc.stdout.readline())["url"]


def _daemon(sock: str, url: str, extra: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    full.update(env)
    proc = subprocess.Popen([sys.executable, "-m", "spotguard", "daemon", "--cloud", "aws", "--metadata-url", url,
                             "--socket", sock, "--node", "node-a", "--log-format", "json", *extra],
                            env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    end = time.monotonic() + 30
    while time.monotonic() < end and _probe(["status", "--live", "--socket", sock])[0] != 0:
        time.sleep(0.2)
    time.sleep(3.0)  # a few polls: the identity document is read, the idle state is reached
    return proc


def _probe(args: list[str]) -> tuple[int, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rc = subprocess.run([sys.executable, "-m", "spotguard", *args], capture_output=True, timeout=30).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over children so far
    return rc, max(after, before) / 1024


def _probe_rss(args: list[str]) -> float:
    """One probe's own peak: a fresh child of a fresh parent (RUSAGE_CHILDREN is a max over all children)."""
    code = ("import resource, subprocess, sys\n"
            f"subprocess.run([sys.executable, '-m', 'spotguard', *{args!r}], capture_output=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return int(out.stdout.strip()) / 1024


def _notice(url: str) -> None:
    req = urllib.request.Request(f"{url}/_emulator/notice", data=json.dumps({"cloud": "aws", "kind": "termination"})
                                 .encode(), headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).close()  # noqa: S310


def run() -> dict[str, Any]:
    emu, url = _emulator()
    kube, aws, hooks = Mute(), Mute(), Mute()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": kube.url}}], "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        env = {"KUBECONFIG": str(kubeconfig), "AWS_ENDPOINT_URL": aws.url, "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
        try:
            plain = _daemon(os.path.join(tmp, "p.sock"), url, [], env)
            out["idle_plain_mb"] = round(_mb(plain.pid, "VmRSS"), 1)
            plain.terminate()
            plain.wait(10)
            sock = os.path.join(tmp, "a.sock")
            d = _daemon(sock, url, ["--kubernetes-node-actions", "--asg-lifecycle-hook", "auto",
                                    "--webhook-url", f"{hooks.url}/h", "--slack-webhook-url", f"{hooks.url}/s"], env)
            out["idle_all_actions_mb"] = round(_mb(d.pid, "VmRSS"), 1)
            out["idle_all_actions_peak_mb"] = round(_mb(d.pid, "VmHWM"), 1)
            out["probe_live_mb"] = round(_probe_rss(["status", "--live", "--socket", sock]), 1)
            out["probe_check_mb"] = round(_probe_rss(["status", "--check", "--socket", sock]), 1)
            _notice(url)
            end = time.monotonic() + 30
            while time.monotonic() < end and not (kube.conns and aws.conns):
                time.sleep(0.1)
            from spotguard.daemon.client import Subscription  # noqa: F401  (the hook's report is not needed)
            time.sleep(3.0)
            out["notice_rss_mb"] = round(_mb(d.pid, "VmRSS"), 1)
            out["notice_peak_mb"] = round(_mb(d.pid, "VmHWM"), 1)
            out["notice_reached"] = {"kube": len(kube.conns), "aws": len(aws.conns), "webhooks": len(hooks.conns)}
            d.terminate()
            d.wait(10)
        finally:
            emu.terminate()
            emu.wait(10)
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
