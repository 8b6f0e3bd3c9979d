"""``spotguard demo --engine torchft`` end to end: the printed timeline and its verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")


def test_demo_torchft_prints_the_timeline_and_a_bitwise_heal(short_tmp: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spotguard", "demo", "--engine", "torchft", "--workdir", str(short_tmp),
         "--steps", "40", "--notice-at", "8", "--step-time", "0.1"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "g1 leaves after committed step" in text
    assert "2 replicas voting" in text and "3 replicas voting" in text
    assert "bitwise equal to g0 and g2 at every step since: True" in text
    assert "0 steps lost" in text
