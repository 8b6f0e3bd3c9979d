"""``benchmarks/time_to_safe.py --quick``: the benchmark's own plumbing, end to end, small.

Real daemon, real torchrun jobs, a drill at a random phase, the figures read
back from the hook's log lines; one tiny cell, two trials, a short overhead run.
Not a performance figure (the full run is ``make bench-time-to-safe``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

QuickRuns = dict[str, tuple["subprocess.Popen[str]", Path]]


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRuns]:
    """Both quick runs (the DDP one and ``--framework all``) start together: each has its own daemon and folder,
    and their jobs mostly sleep through calibrated iterations, so the second test finds its run (nearly) done."""
    tmp = tmp_path_factory.mktemp("tts")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = {"ddp": ["--quick"], "frameworks": ["--framework", "all", "--quick", "--cells", "1:1.2:1"]}
    runs: QuickRuns = {}
    for name, args in argv.items():
        out = tmp / f"tts-{name}.json"
        runs[name] = (subprocess.Popen([sys.executable, "-m", "benchmarks.time_to_safe", *args, "--out", str(out)],
                                       cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True), out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _finished(runs: QuickRuns, name: str) -> Path:
    """The run's JSON once it exited 0 (its output's tail otherwise)."""
    proc, out = runs[name]
    try:
        stdout, stderr = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return out


def test_quick_run_measures_every_trial_from_the_hooks_log_lines(quick_runs: QuickRuns) -> None:
    out = _finished(quick_runs, "ddp")
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


def test_framework_quick_run_commits_every_trial_of_all_three_frameworks(quick_runs: QuickRuns) -> None:
    """``--framework all``: Lightning, the transformers Trainer and Accelerate, 8-micro-batch accumulation,
    one trial each (the full run is ``make bench-time-to-safe-frameworks``). Holds whether an adapter acts
    at the next optimizer step (the checkpoint of a later step) or between micro-batches (the last one)."""
    out = _finished(quick_runs, "frameworks")
    res = json.loads(out.read_text())
    assert [c["framework"] for c in res["cells"]] == ["lightning", "hf", "accelerate"]
    assert "overhead_10ms" not in res
    for cell in res["cells"]:
        assert cell["failed"] == 0 and cell["late"] == 0, [r.get("error") or r.get("tail") for r in cell["runs"]]
        assert cell["notice_to_committed_s"]["n"] == cell["trials"] == 1
        assert cell["accumulate"] == 8
        period = cell["iteration_s"]
        (r,) = cell["runs"]
        assert r["exit_codes"] == [143, 143], r
        # Calibrated: the real part of a step is well under the step, the rest is busy time in 8 micro-batches.
        assert 0 < r["real_part_s"] < period and r["sleep_s"] > 0, r
        # The drill came after the warm-up; the checkpoint (its step from the checkpoint_committed line)
        # is the last completed step or a later one, never one the job had not reached.
        assert r["completed_at_send"] >= 3 and 0 <= r["steps_after_notice"] <= 2, r
        assert r["committed_step"] == r["completed_at_send"] + r["steps_after_notice"], r
        # Where the notice landed: the micro-batch running at notice_seen's timestamp.
        assert 0 <= r["micro_at_send"] < 8 and 0 <= r["micro_at_notice"] < 8, r
        assert r["step_at_notice"] >= r["completed_at_send"], r
        # From the hook's log lines: seen after it was sent, committed after it was seen, exit after that.
        assert 0 < r["notice_to_committed_s"] <= r["sent_to_committed_s"] < 3 * period + 20, r
        assert r["notice_to_exit_s"] >= r["notice_to_committed_s"], r
        assert r["seconds_left_at_commit"] > 0 and r["late"] is False, r
