"""``spotguard demo --engine torchft``: a replica group is preempted, the others never stop.

Three torchft replica groups (one process each, gloo on CPU) train with a
lighthouse on loopback, each with its own spotguard daemon. A notice (drill)
reaches group g1's daemon: g1 leaves at a committed step, g0 and g2 keep
stepping with 2 replicas, a replacement g3 starts, heals live from a survivor
and trains on with bitwise equal state. The timeline is printed as it happens
and the survivors' longest gap between steps is measured.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..torchft.launch import Group, ReplicaJob, lighthouse_binary

__all__ = ["run"]


def _when(e: dict[str, Any]) -> float:
    """Wall time of a log event: its ``t`` field, else its ISO timestamp."""
    if "t" in e:
        return float(e["t"])
    return datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


def _steps(g: Group) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in g.steps()}


def run(work: Path, args: argparse.Namespace) -> int:
    if lighthouse_binary() is None:
        print("spotguard demo --engine torchft: torchft is not installed (run `make torchft-tools`)")
        return 2
    steps, notice_at, step_time = max(args.steps, 40), args.notice_at, args.step_time
    print(f"spotguard demo (torchft): 3 replica groups, lighthouse + one daemon each, {steps} steps of "
          f"{step_time:.2f} s; a notice to g1 after step {notice_at}", flush=True)
    with ReplicaJob(work, groups=3, step_time=step_time, steps=steps, end_with=3) as job:
        groups = [job.group(f"g{i}") for i in range(3)]
        # the replacement starts as a warm spare that joins when released: its imports take seconds on a
        # loaded machine, and one arriving after the survivors' last step would train alone from step 0
        g3 = job.group("g3", hold=True)
        if g3.wait_for(lambda e: e.get("event") == "replica_ready", 180) is None:
            print(f"g3 did not start; logs in {work}")
            return 1
        for g in groups:
            if g.wait_for(lambda e: e.get("event") == "replica_step" and e.get("committed")
                          and e["step"] >= notice_at, 180) is None:
                print(f"{g.name} did not reach step {notice_at}; logs in {work}")
                return 1
        t0 = time.time()
        nid = job.notice("g1")
        g0, g1, g2 = groups
        g1.proc.wait(60)
        lines: list[tuple[float, str]] = [(t0, f"notice {nid} sent to g1's daemon (drill, 30 s deadline)")]
        for e in g1.seen:
            if e.get("event") == "notice_seen":
                lines.append((_when(e), f"g1 hook: notice seen ({e.get('seconds_left')} s left); g1 is leaving"))
            elif e.get("event") == "replica_left":
                lines.append((_when(e), f"g1 leaves after committed step {e['step']} (exit {g1.proc.returncode})"))
        left = next((e["step"] for e in g1.seen if e.get("event") == "replica_left"), None)
        g3.release()
        lines.append((time.time(), "replacement g3 joins (fresh daemon)"))
        for g in (g0, g2, g3):
            g.proc.wait(300)
        s0, s2, s3 = _steps(g0), _steps(g2), _steps(g3)
        healed = min(s3, default=-1)
        for n in sorted(s0):
            e = s0[n]
            if left is not None and (left - 1 <= n <= left + 2 or healed <= n <= healed + 1):
                note = " <- g3 healed from a survivor (not yet voting)" if n == healed else ""
                lines.append((e["t"], f"g0 step {n}: {e['participants']} replicas voting, digest {e['digest']}"
                                      f"{'  g3: ' + s3[n]['digest'] if n in s3 else ''}{note}"))
        for t, text in sorted(lines):
            print(f"  [{t - t0:+7.3f}s] {text}", flush=True)
        after = [e for e in g0.steps() if left is not None and e["step"] >= left]
        gaps = [b["t"] - a["t"] for a, b in zip(after, after[1:])]
        lost = sum(1 for g in (g0, g2) for e in g.seen if e.get("event") == "replica_step" and not e.get("committed"))
        # a heal means: g3's first committed step is a global step after g1's leave, shared with the
        # survivors; then every step of g3 is compared with g0's and g2's at the same global step
        joined = left is not None and healed > left and max((e["participants"] for e in s3.values()), default=0) > 1
        equal = joined and all(n in s0 and n in s2 and s3[n]["digest"] == s0[n]["digest"] == s2[n]["digest"]
                               for n in s3)
        if left is None:
            print(f"\n  g1 did not leave at a committed step (exit {g1.proc.returncode}: it may have finished its "
                  f"{steps} steps before the notice reached it on a busy machine); logs in {work}", flush=True)
        elif not joined:
            print(f"\n  g3 did not heal from a survivor (first committed step {min(s3, default=None)}, "
                  f"g1 left after step {left}); logs in {work}", flush=True)
        print(f"\n  g0, g2: {len(s0)} steps, never stopped: longest gap after the leave "
              f"{max(gaps, default=0.0):.3f} s (a step takes {step_time:.2f} s); {lost} steps lost", flush=True)
        print(f"  g3 healed from a survivor at step {min(s3, default=None)}; bitwise equal to g0 and g2 "
              f"at every step since: {equal}", flush=True)
        return 0 if equal and g1.proc.returncode == 143 else 1


def main(args: argparse.Namespace) -> int:
    import shutil

    work = Path(args.workdir).resolve() / "torchft"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return run(work, args)
