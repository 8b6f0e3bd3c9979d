"""Elastic resume under real ``torchrun`` (gloo, CPU): 2 -> 1 -> 4 ranks with a fixed global batch of 32.

What must hold at each resume on another world size (issue 11): the scheduler's
``last_epoch`` and LR equal the uninterrupted run's at that step on every rank;
every sample id is seen exactly once per epoch and each global batch is the
uninterrupted run's; the final weights are within 20x the float noise measured
here between uninterrupted runs at 1, 2 and 4 ranks; new ranks get derived,
distinct RNG streams. Model and optimizer are resharded by DCP under DDP and
under FSDP2 (``fully_shard``, which runs on CPU/gloo with torch 2.13).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import torch

from ._torchrun import TorchRun

SCRIPT = Path(__file__).with_name("_elastic_train.py")
STEPS, SAMPLES, GLOBAL_BATCH = 20, 192, 32
PER_EPOCH = SAMPLES // GLOBAL_BATCH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_job(tmp: Path, name: str, nproc: int, args: list[str], records: Path, steps: int = STEPS) -> TorchRun:
    records.mkdir(exist_ok=True)
    run = TorchRun(tmp / f"{name}.log", ["--steps", str(steps), "--records", str(records), *args],
                   script=SCRIPT, nproc=nproc)
    run.wait(180)
    return run


def ids_by_step(records: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for f in records.glob("ids-rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[r["step"]] += r["ids"]
    return dict(out)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5
    den = sum(float(a[k].double().norm() ** 2) for k in a) ** 0.5
    return num / den


def make_references(tmp: Path, steps: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    """Uninterrupted runs at each world size: final weights, per-step LR, ids; and the float noise between them."""
    outs, lines, ids = {}, {}, {}
    for w in worlds:
        run = run_job(tmp, f"ref{w}", w, ["--no-hook", "--out", str(tmp / f"ref{w}.pt")], tmp / f"ids{w}",
                      steps=steps)
        assert run.proc.returncode == 0, run.tail()
        outs[w] = torch.load(tmp / f"ref{w}.pt", weights_only=True)
        lines[w] = {e["step"]: e for e in run.lines() if "loss" in e}
        ids[w] = {s: sorted(v) for s, v in ids_by_step(tmp / f"ids{w}").items()}
    assert all(ids[w] == ids[worlds[0]] for w in worlds)  # the same global batches at every world size
    noise = max(rel_diff(outs[a]["model"], outs[b]["model"]) for a, b in combinations(outs, 2))
    return {"out": outs, "steps": lines[worlds[0]], "noise": noise, "ids": ids[worlds[0]]}


def check_epochs(records: Path, references: dict[str, Any], steps: int) -> None:
    """Every step's global batch is the uninterrupted run's; each sample exactly once per epoch."""
    check_epochs(records, references, STEPS)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    ref4 = references["out"][4]
    assert (final["last_epoch"], final["lr"]) == (ref4["last_epoch"], ref4["lr"])
    noise = references["noise"]
    diff = rel_diff(ref4["model"], final["model"])
    print(f"elastic {chain}: relative weight difference {diff:.3g}, noise between world sizes {noise:.3g}")
    assert diff <= 20 * noise, (diff, noise)
