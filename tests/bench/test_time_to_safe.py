"""``benchmarks/time_to_safe.py --quick``: the benchmark's own plumbing, end to end, small.

Real daemon, real torchrun jobs, a drill at a random phase, the figures read
back from the hook's log lines; one tiny cell, two trials, a short overhead run.
Not a performance figure (the full run is ``make bench-time-to-safe``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_quick_run_measures_every_trial_from_the_hooks_log_lines(tmp_path: Path) -> None:
    out = tmp_path / "tts.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.time_to_safe", "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    (cell,) = res["cells"]
    assert cell["failed"] == 0, [r.get("error") for r in cell["runs"]]
    assert cell["notice_to_committed_s"]["n"] == cell["trials"] == 2
    period = cell["iteration_s"]
    for r in cell["runs"]:
        assert 0 <= r["phase"] < 1
        assert r["exit_codes"] == [143, 143], r
        # The drill was sent during the first timed iteration; the checkpoint stands for a step at or
        # after the one completed then, and never one the job had not reached.
        assert r["completed_at_send"] >= 3 and 0 <= r["steps_after_notice"] <= 2, r
        # Seen after it was sent, committed after it was seen, all within a few iterations.
        assert 0 < r["notice_to_committed_s"] <= r["sent_to_committed_s"] < 3 * period + 20, r
        assert r["notice_to_exit_s"] >= r["notice_to_committed_s"], r
        assert r["seconds_left_at_commit"] > 0, r
    s = cell["notice_to_committed_s"]
    assert s["min"] <= s["p50"] <= s["p99"] <= s["max"]
    ov = res["overhead_10ms"]
    assert "error" not in ov, ov
    assert len(ov["blocks_us_with"]) == len(ov["blocks_us_without"]) == ov["blocks"] == 2
    assert ov["us_per_step_without"] >= 10_000 and ov["us_per_step_with"] >= 10_000  # a 10 ms step at least
