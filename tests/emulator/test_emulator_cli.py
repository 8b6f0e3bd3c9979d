"""``spotguard emulate`` as a real process: listening line, requests, SIGTERM -> exit 0.

Synchronous on purpose (subprocess + urllib): no event-loop child watcher involved.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import urllib.request

import pytest

COMMANDS = {
    "cli": [sys.executable, "-m", "spotguard", "emulate", "--port", "0", "--azure-vm-name", "cli-vm"],
    "module": [sys.executable, "-m", "spotguard.emulator.server", "--port", "0", "--azure-vm-name", "cli-vm"],
}


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else b""


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_emulate_process_lifecycle(how: str) -> None:
    proc = subprocess.Popen(COMMANDS[how], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = _readline(proc, 30)
        if not line:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"emulator gave no listening line: {err.decode(errors='replace')[-2000:]}")
        hello = json.loads(line)
        assert hello["event"] == "listening" and hello["url"].startswith("http://127.0.0.1:")
        base = hello["url"]
        req = urllib.request.Request(f"{base}/metadata/instance/compute?api-version=2021-02-01", headers={"Metadata": "true"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["name"] == "cli-vm"
        req = urllib.request.Request(
            f"{base}/_emulator/notice",
            data=json.dumps({"cloud": "aws", "kind": "preemption"}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["id"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err.decode(errors="replace")
        assert out == b""  # stdout carries only the listening line
        assert b'"notice_scheduled"' in err  # JSON logs on stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_emulate_flags_like_amazon_ec2_metadata_mock() -> None:
    """--aws-recompute-time and --aws-rebalance-lead reach the served documents."""
    from spotguard.launch import start_emulator

    emu = start_emulator(extra_args=["--aws-recompute-time", "--aws-rebalance-lead", "30"])
    try:
        config = emu.control("config")["config"]
        assert config["aws_recompute_time"] is True and config["aws_rebalance_lead"] == 30.0
        emu.notice("aws", "preemption", 120)
        with urllib.request.urlopen(f"{emu.url}/_emulator/state", timeout=10) as r:  # noqa: S310
            state = json.loads(r.read())
        kinds = sorted(n["kind"] for n in state["notices"] if n["status"] == "active")
        assert kinds == ["preemption", "rebalance"]  # the recommendation first; the spot notice 30 s later
    finally:
        emu.stop()


def test_emulate_rejects_a_negative_rebalance_lead() -> None:
    out = subprocess.run([sys.executable, "-m", "spotguard", "emulate", "--port", "0", "--aws-rebalance-lead", "-1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--aws-rebalance-lead" in out.stderr
