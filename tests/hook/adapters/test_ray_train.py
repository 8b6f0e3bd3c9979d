"""Ray Train: 2 local CPU workers, a notice to one worker, commit, report, FailureConfig restart, exact resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray.train")

from .._torchrun import REPO, first_difference, load_out
from ._jobs import HUB_OFFLINE, committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 24


class _Ray:
    """``examples/ray_train.py`` in its own Ray instance (its own short ``RAY_TMPDIR``: two may run at once)."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.name, self.tmp = name, tmp
        self.ray_tmp = tempfile.mkdtemp(prefix="sgray-", dir="/tmp")  # AF_UNIX paths: keep it short
        env = {**os.environ, **HUB_OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
               "SPOTGUARD_SOCKET": str(tmp / "no-daemon.sock"), "RAY_TMPDIR": self.ray_tmp}
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "ray_train.py"), *args], cwd=tmp,
                                         env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)

    def result(self, timeout: float = 200) -> tuple[int, list[dict], str]:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.stop()
        out = self.log.read_text(errors="replace")
        lines = []
        for raw in out.splitlines():
            i = raw.find("{")
            if i >= 0:
                try:
                    lines.append(json.loads(raw[i:].split("\x1b")[0]))
                except ValueError:
                    pass
        return rc, lines, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def test_preempted_worker_restarted_by_failure_config_resumes_exactly(tmp_path: Path) -> None:
    # the uninterrupted run and the preempted one are independent: both at once (most of a Ray run is waiting
    # on its own start-up, not CPU), in two Ray instances
    store = tmp_path / "ckpt"
    runs = [_Ray(tmp_path, "reference", "--steps", str(STEPS), "--storage", str(tmp_path / "ref-ckpt"),
                 "--out", str(tmp_path / "ref.pt"), "--step-time", "0")]
    try:
        runs.append(_Ray(tmp_path, "preempted", "--steps", str(STEPS), "--storage", str(store),
                         "--preempt-at", "8", "--out", str(tmp_path / "resumed.pt"), "--step-time", "0.1"))
        (rc, ref_lines, out), (rc_pre, lines, out_pre) = (r.result() for r in runs)
    finally:
        for r in runs:
            r.stop()
    assert rc == 0, out[-4000:]
    ref = {e["step"]: e["hex"] for e in ref_lines if "hex" in e}
    assert sorted(ref) == list(range(STEPS))

    rc, out = rc_pre, out_pre
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
