"""``make gpu-check`` on a machine without CUDA: one SKIP line, exit 0, the JSON summary says why.

The checks themselves need a GPU (benchmarks/gpu_check.py); nothing here measures CUDA.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check would run for real")
def test_skips_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(REPO)}
    env.pop("SG_GPU_CHECK_DEVICE", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("SKIP gpu-check: no CUDA device")
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["pass"] is True and "no CUDA device" in summary["skipped"]
    assert "checks" not in summary  # nothing was measured, and the summary does not pretend otherwise


def test_cpu_dry_run_of_the_kit(tmp_path):
    """SG_GPU_CHECK_DEVICE=cpu runs the kit's own plumbing (children, torchrun, the real hook's preempt
    and resume, result parsing) on gloo with tiny sizes, so a broken script is found here and not in
    scarce GPU time. Not a GPU figure: the summary says so."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(REPO),
           "SG_GPU_CHECK_DEVICE": "cpu", "SG_GPU_CHECK_ONLY": "staging,rng,anytime",
           "SG_GPU_CHECK_ANYTIME_TRIALS": "2"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["mode"].startswith("cpu-dry-run"), summary
    assert set(summary["checks"]) == {"staging", "rng", "anytime"}
    anytime = summary["checks"]["anytime"]
    assert anytime["pass"], anytime
    assert [t["exact"] for t in anytime["trials"]] == [True, True], anytime  # one plain process, one torchrun job
    rng = summary["checks"]["rng"]
    assert rng["pass"] and rng["resumed_from"] > 0 and not rng["mismatched_steps"], json.dumps(rng, indent=1)
    st = summary["checks"]["staging"]
    assert st["pinned"] is False and st["staging_gibps"] > 0 and st["pool_peak_in_use"] >= 1, st
    # the exit code follows the thresholds, and the staging one is a timing ratio that a loaded CPU
    # may miss (meaningless on a CPU anyway): only its consistency with the summary is asserted
    assert proc.returncode == (0 if summary["pass"] else 1), proc.stderr[-2000:]


def test_make_gpu_check_skips_when_gpu_py_has_no_torch(tmp_path):
    """Issue 23: ``make gpu-check`` with a ``python3`` that lacks torch ended in ModuleNotFoundError;
    it must print the documented SKIP and name GPU_PY (the fix)."""
    blocker = tmp_path / "shadow" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed for this Python (test)')\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(tmp_path / "shadow")}
    env.pop("SG_GPU_CHECK_DEVICE", None)
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={sys.executable}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("SKIP gpu-check:") and "cannot import torch" in first and "GPU_PY=" in first, first
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["pass"] is True and "checks" not in summary
