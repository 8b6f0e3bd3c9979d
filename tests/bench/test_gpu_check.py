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
