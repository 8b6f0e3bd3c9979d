"""The c10d store's host leaves while another rank is finalizing: that rank still exits 0.

Regression (seen in the two-node elastic recipe): the background agreement
thread parks in a C++ ``store.wait``; when the store's host (rank 0's process,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) exits during another rank's
interpreter finalization, the wait returns, the daemon thread dies by
``pthread_exit`` through C++ frames and the process aborts ("terminate called
without an active exception", -6) — torchrun then restarts it and the job
repeats its last steps. ``BackgroundAgreement.release`` (atexit and close) gets
the thread out of the wait first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._torchrun import TorchRun

SCRIPT = Path(__file__).resolve().parent / "_store_host_exit_train.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank_finalizing_when_the_store_host_exits_still_exits_zero(tmp_path: Path) -> None:
    flag = tmp_path / "finalizing"
    run = TorchRun(tmp_path / "run.log", [str(tmp_path / "ck"), str(flag)], script=SCRIPT,
                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    rc = run.wait()
    text = run.log.read_text(errors="replace")
    trained = [e for e in run.lines() if e.get("trained")]
    assert len(trained) == 2 and all(e["background"] for e in trained), run.tail()
    assert flag.exists(), run.tail()  # rank 1 did reach finalization with rank 0 still up
    assert rc == 0 and "terminate called" not in text, run.tail()
