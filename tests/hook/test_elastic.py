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
# 36 steps: test_elastic_recipe's count, so its uninterrupted runs are these (make_references runs each once)
STEPS, SAMPLES, GLOBAL_BATCH = 36, 192, 32
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


_RUNS: dict[tuple[int, int], tuple[dict[str, Any], dict[int, Any], dict[int, list[int]]]] = {}  # this session's


def _start_reference(tmp: Path, steps: int, w: int, attempt: int) -> tuple[str, TorchRun]:
    name = f"ref{w}" if attempt == 0 else f"ref{w}-retry{attempt}"
    (tmp / f"ids-{name}").mkdir(exist_ok=True)
    run = TorchRun(tmp / f"{name}.log", ["--steps", str(steps), "--records", str(tmp / f"ids-{name}"), "--no-hook",
                                         "--out", str(tmp / f"{name}.pt")], script=SCRIPT, nproc=w)
    return name, run


def make_references(tmp: Path, steps: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    """Uninterrupted runs at each world size: final weights, per-step LR, ids; and the float noise between them.
    Each (steps, world size) runs once a session: a later caller (test_elastic_recipe) gets the same results.
    The missing ones start together (each is mostly its processes' imports, one core each)."""
    outs, lines, ids = {}, {}, {}
    started = {w: _start_reference(tmp, steps, w, 0) for w in worlds if (steps, w) not in _RUNS}
    try:
        _finish_references(tmp, steps, worlds, started, outs, lines, ids)
    finally:
        for _, run in started.values():
            run.kill()  # only those a failed wait left running
    assert all(ids[w] == ids[worlds[0]] for w in worlds)  # the same global batches at every world size
    noise = max(rel_diff(outs[a]["model"], outs[b]["model"]) for a, b in combinations(outs, 2))
    return {"out": outs, "steps": lines[worlds[0]], "noise": noise, "ids": ids[worlds[0]]}


def _finish_references(tmp: Path, steps: int, worlds: tuple[int, ...], started: dict[int, tuple[str, TorchRun]],
                       outs: dict[int, Any], lines: dict[int, Any], ids: dict[int, Any]) -> None:
    for w in worlds:
        if (steps, w) in _RUNS:
            outs[w], lines[w], ids[w] = _RUNS[steps, w]
            continue
        # A reference run has no hook: it is not what is under test. torch/gloo itself aborted one at interpreter
        # exit on a loaded CI machine (-6, rank 1, after every step had run); such a run is run again, from
        # scratch in its own folder, at most twice.
        name, run = started[w]
        for attempt in range(1, 4):
            run.wait(180)
            if run.proc.returncode == 0 or attempt == 3:
                break
            name, run = _start_reference(tmp, steps, w, attempt)
        assert run.proc.returncode == 0, run.tail()
        outs[w] = torch.load(tmp / f"{name}.pt", weights_only=True)
        lines[w] = {e["step"]: e for e in run.lines() if "loss" in e}
        ids[w] = {s: sorted(v) for s, v in ids_by_step(tmp / f"ids-{name}").items()}
        _RUNS[steps, w] = outs[w], lines[w], ids[w]


def check_epochs(records: Path, references: dict[str, Any], steps: int) -> None:
    """Every step's global batch is the uninterrupted run's; each sample exactly once per epoch."""
    seen = ids_by_step(records)
    assert sorted(seen) == list(range(steps))
    for s, ids in seen.items():
        assert sorted(ids) == references["ids"][s], s
    for epoch in range(steps // PER_EPOCH):
        got = Counter(i for s in range(epoch * PER_EPOCH, (epoch + 1) * PER_EPOCH) for i in seen[s])
        assert got == Counter(range(SAMPLES)), f"epoch {epoch}: repeated or skipped samples"


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_references(tmp_path_factory.mktemp("elastic-ref"), STEPS, (1, 2, 4))


@pytest.mark.parametrize("passed,workers,wrap,chain", [
    # (what the hook is given, DataLoader workers, model wrapper, [(ranks, step during which rank 0 is preempted)])
    # the 2 -> 1 -> 4; a prefetching worker. serial: its last leg is 4 ranks + 4 loader workers on 2 cores,
    # and beside another test (make test-parallel) it ran past its 180 s leg in both runs (at load 5-12)
    pytest.param("loader", 1, "ddp", [(2, 4), (1, 9), (4, None)], marks=pytest.mark.serial),
    # DDP 1 -> 2 and 2 -> 4, the sampler handed over itself: the loader chain above reaches the same sampler
    # (state.classify unwraps a DataLoader to its ElasticDistributedSampler) and the FSDP2 chain grows 1 -> 2
    pytest.param("sampler", 0, "ddp", [(1, 3), (2, 8), (4, None)], marks=pytest.mark.long(
        reason="sibling in make test: [ddp-2-1-4-loader] (the same sampler state, reached through the loader, "
               "DDP resharded) and [fsdp2-2-1-2-4] (grows 1 -> 2 and 2 -> 4)")),
    ("loader", 0, "fsdp", [(2, 3), (1, 7), (2, 12), (4, None)]),  # FSDP2 (fully_shard) 2 -> 1, 1 -> 2, 2 -> 4
], ids=["ddp-2-1-4-loader", "ddp-1-2-4-sampler", "fsdp2-2-1-2-4"])
def test_elastic_resume_chain(references: dict[str, Any], tmp_path: Path, passed: str, workers: int, wrap: str,
                              chain: list[tuple[int, Any]]) -> None:
    store, records = tmp_path / "store", tmp_path / "ids"
    common = ["--storage", str(store), "--pass", passed, "--workers", str(workers)]
    if wrap == "fsdp":
        common.append("--fsdp")
    expect_start, prev, tally = 0, 0, {}
    for i, (nproc, stop) in enumerate(chain):
        extra = ["--stop-at", str(stop)] if stop is not None else ["--out", str(tmp_path / "final.pt")]
        run = run_job(tmp_path, f"leg{i}", nproc, common + extra, records)
        assert run.proc.returncode == (1 if stop is not None else 0), run.tail()
        resumes = [e for e in run.lines() if "resume" in e]
        assert sorted(e["rank"] for e in resumes) == list(range(nproc)), run.tail()
        for e in resumes:
            assert e["resume"] == expect_start, resumes
            if expect_start:  # scheduler state equals the uninterrupted run's after step expect_start - 1
                ref = references["steps"][expect_start - 1]
                assert (e["last_epoch"], e["lr"]) == (ref["last_epoch"], ref["lr"]), (e, ref)
                assert e["sampler"]["consumed"] == ((expect_start - 1) % PER_EPOCH + 1) * GLOBAL_BATCH
        if expect_start:
            elastic = {e["rank"]: e for e in run.events("elastic_resume")}
            assert sorted(elastic) == list(range(nproc)), run.tail()
            assert all(set(e["global"]) == {"scheduler", "data"} for e in elastic.values())
            assert all(e["old_world_size"] == prev for e in elastic.values())
            # per-rank state (declared with scope=): ranks that existed keep their own, new ranks start fresh
            assert [elastic[r]["per_rank_own" if r < prev else "per_rank_fresh"] for r in range(nproc)] == \
                [["tally"]] * nproc
            assert {e["rank"]: e["tally"] for e in resumes} == {r: tally[r] if r < prev else 0
                                                                 for r in range(nproc)}
            assert [elastic[r]["rng"] for r in range(nproc)] == ["own" if r < prev else "derived"
                                                                 for r in range(nproc)]
            probes = [e["rng"] for e in sorted(resumes, key=lambda e: e["rank"])]
            assert len(set(probes)) == nproc, probes  # no rank got a copy of another's stream
        prev = nproc
        if stop is not None:  # steps each rank's own lineage trained, as its checkpointed per-rank state says
            # a single process acts at any moment (issue 23): the notice at the top of iteration `stop` commits
            # the `stop` completed iterations; under torch.distributed the notice comes at the end of step
            # `stop`, so `stop + 1` are complete. Exact whenever the round joins (it stands at the count it finds);
            # the script awaits the agreement after notify() so that a loaded machine, whose agreement thread
            # may join a few iterations late, still commits these steps (_elastic_train.await_agreement)
            done = stop if nproc == 1 else stop + 1
            tally = {e["rank"]: e["tally"] + done - expect_start for e in resumes}
            expect_start = done
    check_epochs(records, references, STEPS)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    ref4 = references["out"][4]
    assert (final["last_epoch"], final["lr"]) == (ref4["last_epoch"], ref4["lr"])
    noise = references["noise"]
    diff = rel_diff(ref4["model"], final["model"])
    print(f"elastic {chain}: relative weight difference {diff:.3g}, noise between world sizes {noise:.3g}")
    assert diff <= 20 * noise, (diff, noise)
