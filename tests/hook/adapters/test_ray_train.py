"""Ray Train: 2 local CPU workers, a notice to one worker, commit, report, FailureConfig restart, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train")

from .._torchrun import REPO, first_difference, load_out
from ._jobs import HUB_OFFLINE, committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 24


def _ray(tmp: Path, name: str, *args: str) -> tuple[int, list[dict], str]:
    env = {**os.environ, **HUB_OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
           "SPOTGUARD_SOCKET": str(tmp / "no-daemon.sock"), "RAY_TMPDIR": "/tmp"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "ray_train.py"), *args], cwd=tmp, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=200)
    (tmp / f"{name}.log").write_text(proc.stdout)
    lines = []
    for raw in proc.stdout.splitlines():
        i = raw.find("{")
        if i >= 0:
            try:
                lines.append(json.loads(raw[i:].split("\x1b")[0]))
            except ValueError:
                pass
    return proc.returncode, lines, proc.stdout


def test_preempted_worker_restarted_by_failure_config_resumes_exactly(tmp_path: Path) -> None:
    rc, ref_lines, out = _ray(tmp_path, "reference", "--steps", str(STEPS), "--storage", str(tmp_path / "ref-ckpt"),
                              "--out", str(tmp_path / "ref.pt"), "--step-time", "0")
    assert rc == 0, out[-4000:]
    ref = {e["step"]: e["hex"] for e in ref_lines if "hex" in e}
    assert sorted(ref) == list(range(STEPS))

    store = tmp_path / "ckpt"
    rc, lines, out = _ray(tmp_path, "preempted", "--steps", str(STEPS), "--storage", str(store),
                          "--preempt-at", "8", "--out", str(tmp_path / "resumed.pt"), "--step-time", "0")
    assert rc == 0, out[-4000:]  # FailureConfig restarted the group and the run finished
    hook = [e for e in lines if e.get("component") == "hook"]
    agreed = {e["rank"]: e["step"] for e in hook if e["event"] == "agreed"}
    assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, agreed  # the notice reached rank 1 only
    stop = agreed[0]
    assert all(e["code"] == 143 and e["committed"] for e in hook if e["event"] == "exit")
    assert {e["rank"] for e in hook if e["event"] == "reported to ray"} == {0, 1}
    assert committed(store) == [stop]
    resumed = {e["rank"]: e["step"] for e in hook if e["event"] == "resumed" and e["step"] > 0}
    assert resumed == {0: stop, 1: stop}, resumed
    after = {e["step"]: e["hex"] for e in lines if "hex" in e and e.get("attempt_start") == stop}
    assert sorted(after) == list(range(stop, STEPS))
    assert all(ref[k] == v for k, v in after.items()), "resumed losses differ from the uninterrupted run"
    result = next(e for e in lines if e.get("ray_result"))
    assert result["error"] is None and result["checkpoint"], result  # Ray's history holds the pointer checkpoint
    pointer = json.loads((Path(result["checkpoint"]) / "spotguard.json").read_text())
    assert pointer["step"] == stop and pointer["uri"].endswith(f"step-{stop:08d}")
    assert first_difference(load_out(tmp_path / "ref.pt")["model"], load_out(tmp_path / "resumed.pt")["model"]) is None
