"""The report against a real preemption chain's known truth: emulator + daemon + torchrun (2 ranks, gloo, CPU).

Attempt 1: a GCP preemption through the emulator and a real daemon. Attempt 2: SIGTERM to rank 1
(no daemon). Attempt 3 runs to the end. The truth comes from what the training script printed
(its step lines) and the workers' own log lines, never from the history the report reads.
"""

from __future__ import annotations

import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from spotguard.launch import start_daemon, start_emulator
from spotguard.report.cli import build_figures

from tests.hook._daemons import wait_subscribed
from tests.hook._torchrun import TorchRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 24
ARGS = ["--steps", str(STEPS), "--step-time", "0.15"]


def _ts(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def test_report_matches_a_real_two_preemption_chain(tmp_path: Path, short_tmp: Path) -> None:
    store = tmp_path / "ckpt"
    args = [*ARGS, "--storage", str(store)]
    emu = start_emulator(stderr=open(tmp_path / "emulator.log", "w"))  # noqa: SIM115 - the child owns it
    runs: list[TorchRun] = []
    try:
        daemon = start_daemon(str(short_tmp / "d.sock"), cloud="gcp", metadata_url=emu.url,
                              log_path=tmp_path / "daemon.log")
        try:
            run = TorchRun(tmp_path / "a1.log", args, env={"SPOTGUARD_SOCKET": daemon.socket})
            runs.append(run)
            wait_subscribed(daemon.socket, {0, 1}, run)
            run.wait_step(3)
            emu.notice("gcp", in_seconds=30)
            assert run.wait(90) != 0, run.tail()
        finally:
            daemon.stop()
        run = TorchRun(tmp_path / "a2.log", args)  # no daemon: the notice is a SIGTERM
        runs.append(run)
        first = runs[0].events("resumed", 0)
        run.wait_for(lambda: any(s >= 0 for s in run.steps()) and bool(run.events("resumed", 0)), 60, "resume")
        run.wait_step(max(run.steps()[0] + 3, 0))
        run.signal_rank(1, signal.SIGTERM)
        assert run.wait(90) != 0, run.tail()
        run = TorchRun(tmp_path / "a3.log", args)
        runs.append(run)
        assert run.wait(120) == 0, run.tail()
    finally:
        emu.stop()
        for r in runs:
            r.kill()
    assert first and first[0]["step"] == 0

    # the truth, from the runs' own output
    resumed = [r.events("resumed", 0)[0] for r in runs]
    exits = [r.events("exit", 0)[0] for r in runs[:2]]
    printed_end = [max(r.steps()) + 1 for r in runs]  # a step line is printed after its optimizer step
    true_recomputed = sum(max(0, printed_end[i] - resumed[i + 1]["step"]) for i in range(2))
    true_down = [_ts(resumed[i + 1]) - _ts(exits[i]) for i in range(2)]

    fig = build_figures(str(store))
    assert fig.skipped == []
    assert len(fig.attempts) == 3
    assert len(fig.preemptions) == 2, fig.preemptions
    assert sorted(p.source for p in fig.preemptions) == ["gcp", "signal"]
    assert sum(fig.preemptions_by.values()) == 2 and "gcp/preemption" in fig.preemptions_by
    assert fig.steps_recomputed == true_recomputed
    assert [a.resume_step for a in fig.attempts] == [e["step"] for e in resumed]
    assert len(fig.downtime) == 2
    for got, want in zip(fig.downtime, true_down):
        assert abs(got["seconds"] - want) <= 0.1, (fig.downtime, true_down)
        assert got["waiting"] >= 0 and got["restart_load"] > 0
        assert abs(got["waiting"] + got["restart_load"] - got["seconds"]) < 1e-6
    assert fig.time_to_safe_max is not None and 0 < fig.time_to_safe_max < 30
    notice_ckpts = [c for c in fig.checkpoints if c.reason == "notice"]
    assert [c.step for c in notice_ckpts] == [e["step"] for e in resumed[1:]]
    assert all(c.bytes > 0 for c in notice_ckpts) and fig.throughput_mb_s and fig.throughput_mb_s > 0
    assert fig.stored_checkpoints and fig.stored_checkpoints[-1] == resumed[2]["step"]
    assert fig.attempts[-1].end_kind == "process_end" and fig.attempts[-1].last_step == STEPS
    assert 0 < fig.goodput_percent < 100 and fig.wall_seconds > fig.training_seconds > 0
