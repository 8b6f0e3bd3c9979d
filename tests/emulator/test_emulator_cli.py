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
