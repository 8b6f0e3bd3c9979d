"""Goodput per preemption of one torchft replica group out of three (CPU/gloo, real processes).

A fresh job per trial: a lighthouse (``lighthouse_args``: join timeout 200 ms at a
0.1 s step), three replica groups, each with its own spotguard daemon. Trials
alternate in the same run:

(a) spotguard + torchft: a notice (drill) to one group; it leaves at a
    committed step.
(b) torchft alone: the same group is SIGKILLed at a random point of a step
    (the deadline passes without notice); with the same lighthouse flags, and
    (SG_BENCH_DEFAULT_TRIALS, default 3) with the lighthouse's own defaults.

(A fresh job per trial: replacements joining a long-running job are tested in
tests/torchft; here they would add their start-up CPU to the next trial.) Per trial: the survivors' longest
gap between two committed steps in the window (notice/kill - 1 s .. 15 steps
later) minus the median step interval (= the stall), and the survivors' steps
lost (uncommitted steps they had to redo).

(c) spotguard's stop-checkpoint-restart path on the same job: every group gets
the notice, the emergency checkpoint is written, all groups are restarted and
resume from storage; the survivors' gap is the last committed step before
-> first committed step after the restart (no wait for capacity counted).

SG_BENCH_TRIALS (default 10) trials of (a) and (b) each, SG_BENCH_RESTARTS
(default 3) of (c).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spotguard.torchft.launch import Group, ReplicaJob

TRIALS = int(os.environ.get("SG_BENCH_TRIALS", "10"))
RESTARTS = int(os.environ.get("SG_BENCH_RESTARTS", "3"))
DEFAULT_TRIALS = int(os.environ.get("SG_BENCH_DEFAULT_TRIALS", "3"))
#: torchft_lighthouse's own defaults (join timeout 60 s, heartbeat 5 s): torchft alone, untuned
DEFAULT_FLAGS = ["--min_replicas", "1"]
STEP_TIME = 0.1
START = 180.0


def _participating(g: Group, n: int, timeout: float) -> bool:
    """Wait until ``g`` commits a step with ``n`` participants."""
    return g.wait_for(lambda e: e.get("event") == "replica_step" and e.get("committed")
                      and e.get("participants") == n, timeout) is not None


def _window(g: Group, t0: float, steps_after: int = 15) -> list[dict[str, Any]]:
    evs = [e for e in g.seen if e.get("event") == "replica_step" and e["t"] >= t0 - 1.0]
    out, after = [], 0
    for e in evs:
        out.append(e)
        if e["t"] > t0 and e.get("committed"):
            after += 1
            if after >= steps_after:
                break
    return out


def _measure(survivors: list[Group], t0: float) -> tuple[float, int, float]:
    """(longest gap, steps lost, median interval) over the survivors, after waiting for 15 more steps."""
    gaps, lost, med = [], 0, []
    for g in survivors:
        win = _window(g, t0)
        com = [e for e in win if e.get("committed")]
        d = [b["t"] - a["t"] for a, b in zip(com, com[1:])]
        gaps.append(max(d))
        med.append(statistics.median(d))
        lost = max(lost, sum(1 for e in win if not e.get("committed")))
    return max(gaps), lost, statistics.median(med)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _summary(rows: list[tuple[float, int, float]]) -> dict[str, Any]:
    stalls = [max(0.0, gap - med) for gap, _, med in rows]
    return {
        "trials": len(rows),
        "longest_gap_s": {"median": round(statistics.median(r[0] for r in rows), 3),
                          "p99": round(_pct([r[0] for r in rows], 99), 3), "max": round(max(r[0] for r in rows), 3)},
        "stall_s": {"median": round(statistics.median(stalls), 3), "p99": round(_pct(stalls, 99), 3)},
        "steps_lost": {"total": sum(r[1] for r in rows), "max": max(r[1] for r in rows)},
        "step_interval_s": round(statistics.median(r[2] for r in rows), 3),
    }


def _fresh(work: Path, tag: str, flags: list[str] | None = None) -> tuple[ReplicaJob, list[Group]]:
    job = ReplicaJob(work / tag, groups=3, step_time=STEP_TIME, steps=10**6, lighthouse_flags=flags)
    live = [job.group(f"g{i}") for i in range(3)]
    for g in live:
        if not _participating(g, 3, START):
            job.stop()
            raise RuntimeError(f"{g.name} never joined (see {work / tag})")
    for g in live:  # a few steps in full quorum before the event
        g.wait_for(lambda e: e.get("event") == "replica_step" and e["step"] >= 8, START)
    return job, live


def run() -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="sg-ft-", dir="/tmp"))
    rows: dict[str, list[tuple[float, int, float]]] = {"a_notice": [], "b_kill": [], "b_kill_default_flags": [],
                                                       "c_restart": []}
    rng = random.Random(7)
    modes = ["a_notice", "b_kill"] * TRIALS + ["b_kill_default_flags"] * DEFAULT_TRIALS
    try:
        for trial, mode in enumerate(modes):  # (a) and (b) interleaved, a fresh job each
            (work / str(trial)).mkdir()
            job, live = _fresh(work, str(trial), DEFAULT_FLAGS if mode == "b_kill_default_flags" else None)
            with job:
                victim, survivors = live[1], [live[0], live[2]]
                if mode == "a_notice":
                    t0 = time.time()
                    job.notice(victim.name)
                else:
                    time.sleep(rng.uniform(0, STEP_TIME))
                    t0 = time.time()
                    victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(60)
                for g in survivors:
                    g.wait_for(lambda e, t=t0: e.get("event") == "replica_step" and e["t"] > t + 3.0
                               and e.get("participants") == 2, 90)
                rows[mode].append(_measure(survivors, t0))
            print(f"  {mode} trial {len(rows[mode])}: gap {rows[mode][-1][0]:.3f} s, lost {rows[mode][-1][1]}",
                  flush=True)
        for r in range(RESTARTS):  # (c) every group noticed: emergency checkpoint, restart, resume
            tag = f"c{r}"
            (work / tag).mkdir()
            job, live = _fresh(work, tag)
            with job:
                t0 = time.time()
                for g in live:
                    job.notice(g.name)
                for g in live:
                    g.proc.wait(60)
                t_last = max(e["t"] for g in live for e in g.steps())
                for g in live:
                    job.drop_daemon(g.name)
                again = [job.group(f"r{i}") for i in range(3)]
                firsts = []
                for g in again:
                    e = g.wait_for(lambda e: e.get("event") == "replica_step" and e.get("committed"), START)
                    assert e is not None, f"{g.name} did not resume (see {work / tag})"
                    firsts.append(e["t"])
            rows["c_restart"].append((min(firsts) - t_last, 0, STEP_TIME))  # checkpoint = last committed step
            print(f"  c_restart {r + 1}: gap {rows['c_restart'][-1][0]:.3f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # raw rows: (survivors' longest gap s, steps lost, median step interval s) per trial; the load says how
    # busy the machine was (the gap is a wall-clock figure)
    return {"groups": 3, "step_time_s": STEP_TIME, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            **{k: _summary(v) for k, v in rows.items() if v},
            "raw": {k: [[round(g, 4), lost, round(med, 4)] for g, lost, med in v] for k, v in rows.items()}}


if __name__ == "__main__":
    import json

    res = {"loadavg_start": [round(x, 2) for x in os.getloadavg()], **run()}
    text = json.dumps(res, indent=2)
    print(text)
    out = Path(os.environ.get("SG_BENCH_OUT", Path(__file__).parent / "results" / "bench_torchft.json"))
    out.write_text(text + "\n")
    print(f"raw results: {out}")
