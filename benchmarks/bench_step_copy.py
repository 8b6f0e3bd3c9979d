"""Per-iteration cost of the step copies (issue 23, ``spotguard/hook/stepcopy.py``) on this machine's CPU.

A discriminator of ``LAYERS`` square ``Linear`` layers whose parameters + Adam's two moments total ``MIB`` MiB
(what ``time_to_safe.py --gan`` uses): ``StepCopies.before_first_step`` (what D's first step of an iteration
pays on the training thread), ``reset`` at each boundary, repeated; the median and p90 of ``REPEATS``, beside
the cost of one ``optimizer.step()`` of the same optimizer (every parameter with a gradient) for scale.

``python -m benchmarks.bench_step_copy [--mib 64,256] [--repeats 30] [--label NAME]`` writes
``benchmarks/results/step_copy-<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from spotguard.hook.stepcopy import StepCopies

LAYERS = 4
RESULTS = Path(__file__).resolve().parent / "results"


def _cell(mib: float, repeats: int) -> dict[str, Any]:
    dim = int(math.sqrt(mib * 2**20 / 12 / LAYERS))  # fp32 param + exp_avg + exp_avg_sq = 12 B each
    torch.manual_seed(0)
    d = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])
    opt = torch.optim.Adam(d.parameters(), lr=1e-4)
    for p in d.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # every parameter has Adam's moments
    copies = StepCopies(max_bytes=1 << 40)
    copy_s, step_s = [], []
    for i in range(repeats + 2):
        copies.reset(i)
        t0 = time.perf_counter()
        assert copies.before_first_step("opt_d", opt, "d", d) is None
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= 2:  # the first two allocate the buffers and warm up
            copy_s.append(t1 - t0)
            step_s.append(t2 - t1)
    q = statistics.quantiles(copy_s, n=10)
    return {"mib": mib, "state_bytes": copies.nbytes, "repeats": repeats,
            "copy_ms_p50": round(statistics.median(copy_s) * 1e3, 2), "copy_ms_p90": round(q[-1] * 1e3, 2),
            "adam_step_ms_p50": round(statistics.median(step_s) * 1e3, 2), "copy_ms_all": [round(s * 1e3, 2) for s in copy_s]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="64,256")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the time_to_safe workers use 1)")
    ap.add_argument("--label", default="latest")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out: dict[str, Any] = {"what": "StepCopies.before_first_step (params + Adam moments copied into reused buffers) "
                                   "per iteration, CPU", "threads": a.threads, "load_avg_start": os.getloadavg(),
                           "cells": [_cell(float(m), a.repeats) for m in a.mib.split(",")]}
    out["load_avg_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"step_copy-{a.label}.json"
    path.write_text(json.dumps(out, indent=1))
    for c in out["cells"]:
        print(f"{c['mib']:.0f} MiB: copy {c['copy_ms_p50']} ms p50 / {c['copy_ms_p90']} ms p90; "
              f"Adam step {c['adam_step_ms_p50']} ms p50")
    print(f"load {out['load_avg_start']} -> {out['load_avg_end']}; {path}")


if __name__ == "__main__":
    main()
