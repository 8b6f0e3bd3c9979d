"""The shortened chaos run (5 preemptions, every fault and damage kind once) inside ``make test``; ``make chaos`` runs 24.

~1.5-2.5 minutes on 2 cores. The table is printed; the rules of ``driver.verdict`` must hold:
no resume from an incomplete checkpoint, every resume from the newest commit, no hung rank,
at most one step lost per committed emergency checkpoint, same-VM replays exit at once, and
the final model + optimizer state bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from .driver import Chaos, render, verdict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_short_chaos_run(tmp_path: Path, capsys: Any) -> None:
    chaos = Chaos(tmp_path, preemptions=5, seed=11)
    try:
        summary = chaos.run()
    finally:
        chaos.close()
    with capsys.disabled():
        print("\n" + "\n".join(summary["cycles"]) + "\n" + render(summary) + f"\nreport: {summary['report']}")
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=2))
    assert summary["preemptions"] == 5
    assert summary["storage"] == "s3", "the storage faults always run: S3 (moto) is a test dependency"
    assert set(summary["faults_not_exercised"]) <= {"notice_during_periodic"}, summary["faults_not_exercised"]
    exercised = set(summary["faults"]) | set(summary["faults_not_exercised"])
    assert len(exercised) == 13, f"every fault kind is injected (or reported as not exercised): {exercised}"
    assert summary["checkpoints_committed"] >= 1 and summary["resumes_from_committed_step"] >= 1
    rep = summary["report"]  # spotguard report over the run's history on S3, written through the faults
    assert rep["skipped"] == [], rep
    assert rep["attempts"] >= summary["preemptions"] + 1 and 1 <= rep["preemptions"] <= summary["preemptions"], rep
    bad = verdict(summary)
    assert not bad, "\n".join(bad) + f"\nlogs: {tmp_path}\n" + render(summary)
    shutil.rmtree(tmp_path, ignore_errors=True)  # pass: the gigabytes of logs are not kept
