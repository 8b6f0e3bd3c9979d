"""Vanished node: seconds from node B's freeze (SIGSTOP, like a powered-off VM) to the end of node A's ranks.

Two torchrun agents ("nodes") x 2 ranks on loopback, c10d rendezvous, a local-folder storage; node B frozen
at each point of ``tests/chaos/vanish.py``'s grid (mid-iteration with A in the user's DDP all-reduce,
mid-agreement, mid-save, just after the commit; with a notice on B, on A, or none). Per point: p50 / p99 /
max of freeze -> last of A's workers gone, the exit codes, and whether every trial passed the checks
(nothing partial committed, the newest committed checkpoint verifies, a fresh job resumes from it).

Not a ``bench_*`` module (``python -m benchmarks`` skips it): ~35 s a trial on 2 cores. Run::

    python -m benchmarks.vanished_node --trials 3 [--peer-timeout 3] [--out benchmarks/results/vanished_node.json]

The raw trials go to ``benchmarks/results/vanished_node.jsonl``; figures in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.chaos.vanish import exit_bound, grid, run_trial  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = q * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 3)


def summarize(trials: list[dict[str, Any]], peer_timeout: float) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for t in trials:
        points.setdefault(f"{t['point']}/{t['notice']}", []).append(t)
    out: dict[str, Any] = {}
    for key, ts in points.items():
        xs = [t["a_exit_seconds"] for t in ts if t["a_exit_seconds"] is not None]
        out[key] = {
            "trials": len(ts), "passed": sum(bool(t["ok"]) for t in ts), "hung": len(ts) - len(xs),
            "p50_s": _pct(xs, 0.5) if xs else None, "p99_s": _pct(xs, 0.99) if xs else None,
            "max_s": max(xs) if xs else None, "min_s": min(xs) if xs else None,
            "codes": sorted({c for t in ts for c in t["a_codes"].values() if c is not None}),
            "how": sorted({h for t in ts for h in t["a_how"].values()}),
        }
    xs = [t["a_exit_seconds"] for t in trials if t["a_exit_seconds"] is not None]
    return {"peer_timeout_s": peer_timeout, "peer_interval_s": min(0.5, peer_timeout / 4),
            "bound_s": round(peer_timeout + 1.5, 3), "asserted_in_tests_s": exit_bound(peer_timeout),
            "all": {"trials": len(trials), "p50_s": _pct(xs, 0.5) if xs else None,
                    "p99_s": _pct(xs, 0.99) if xs else None, "max_s": max(xs) if xs else None},
            "points": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="trials per point")
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--out", default=str(RESULTS / "vanished_node.json"))
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vanish-bench-"))
    raw = Path(args.out).with_suffix(".jsonl")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("")
    trials: list[dict[str, Any]] = []
    for k in range(args.trials):
        for point, notice in grid():
            t = asdict(run_trial(point, notice, work / f"{point}-{notice}-{k}", peer_timeout=args.peer_timeout,
                                 seed=k))
            trials.append(t)
            with open(raw, "a") as f:
                f.write(json.dumps(t) + "\n")
            print(json.dumps({k: t[k] for k in ("point", "notice", "ok", "a_exit_seconds", "a_codes", "problems")}),
                  flush=True)
    summary = summarize(trials, args.peer_timeout)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if all(t["ok"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
