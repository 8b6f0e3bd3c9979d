"""DeepSpeed time to safe (issue 29): spotguard's hook against ``save_checkpoint`` + an upload, same run, same store.

ZeRO-2 and ZeRO-3, 2 ranks ``torchrun`` on CPU (gloo, ``DS_ACCELERATOR=cpu``), a
``DeepSpeedEngine`` of ``LAYERS`` square ``Linear`` layers sized so that fp32
parameters + AdamW's two moments are 64 MiB or 1 GiB (every layer trains). An
iteration is ``busy(s)`` (simulated compute) then the real ``engine(x)``,
``engine.backward``, ``engine.step()``; ``s`` is calibrated in the job so an
iteration lasts the cell's period (or the real step plus 0.2 s when that is longer:
1 GiB on 2 shared cores). Storage: ``benchmarks/s3sink.py`` (an S3 that
discards bodies: the local object stores are far slower than the machine, so the
figure would be the emulator's). Every job holds one trial of each method:

1. **baseline** (what a user would script): a timer on rank 0 raises a flag at a
   uniformly random phase of an iteration (an ideal, zero-latency notice); after
   each ``engine.step()`` the ranks ``all_reduce`` it; once set, every rank runs
   ``engine.save_checkpoint(<local folder>)``, then uploads the files it wrote
   (rank 0 also the shared ones: ``latest``, ``zero_to_fp32.py``) with boto3's
   ``upload_file`` (multipart, its default concurrency) to the same sink, each
   file's spotguard checksum (block CRC32C, ``Checksummer``) computed first in a
   pass over the file — the same integrity as spotguard's; ``checksum_s`` is that
   pass, so the figure without it can be read off —, a barrier, and rank 0 puts a
   commit marker listing files and checksums. Figure: flag raised -> marker put.
   The local folder is removed afterwards.
2. **spotguard**: ``install_preemption_hook(engine, "s3://...")``; a ``preemption``
   drill through a real ``spotguard daemon --cloud none`` at a uniformly random
   phase of a later iteration; the hook agrees a step, streams DeepSpeed's files
   to the sink with checksums, commits, exits. Figure: the hook's ``notice_seen``
   -> ``checkpoint_committed`` (log timestamps), and drill sent -> committed.

The baseline runs first in each job (the hook's trial ends the job); each trial
is a fresh job. ``speedup`` = baseline p50 / spotguard p50 (and per trial).

    python -m benchmarks.deepspeed_time_to_safe [--cells STAGE:MIB:SECONDS:TRIALS,...] [--label L] [--quick]

writes ``benchmarks/results/deepspeed_time_to_safe-<label>.json``; ``make bench-deepspeed`` runs the full set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script by torchrun: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks._util import busy, free_port, json_lines, log_time  # noqa: E402
from benchmarks.time_to_safe import (AFTER, DEADLINE_S, LAYERS, TRIAL_PREFIX, _cancel, _emit,  # noqa: E402
                                     _prefixed, _stateful_loader, _summary, _torchrun, _wait_subscribed,
                                     calibrate, drill_at, hook_figures)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BUCKET = "bench"
# (ZeRO stage, MiB, iteration s, trials); 1 GiB: 3 trials (its real step is 13-17 s on 2 shared cores: ~3 min a job)
CELLS = [(2, 64, 1.5, 10), (3, 64, 1.5, 10), (2, 1024, 4.0, 3), (3, 1024, 4.0, 3)]
QUICK_CELLS = [(2, 4, 0.6, 1)]
GAP = 2  # plain iterations between the baseline's save and the spotguard drill


# ----------------------------------------------------------------------------------------- worker

def _engine(stage: int, state_mib: float) -> tuple[Any, int]:
    import deepspeed
    import torch

    dim = int(math.sqrt(state_mib * 2**20 / 12 / LAYERS))  # fp32 param + exp_avg + exp_avg_sq = 12 B each
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine, dim


def _client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(s3={"addressing_style": "path", "payload_signing_enabled": False}))


def _checksum(path: Path) -> dict[str, Any]:
    """spotguard's digest of a file (the same block CRC32C its commit record holds), one pass over it."""
    from spotguard.storage.integrity import Checksummer

    summer, buf = Checksummer(), bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            summer.update(view[:n])
    d = summer.digest()
    return {"size": d.size, "blocks": d.blocks}


def _mine(folder: Path, rank: int) -> list[Path]:
    """The files of DeepSpeed's save this rank uploads: its own ``zero_pp_rank_<r>_`` files; rank 0 the rest."""
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        owner = int(p.name.split("_")[3]) if p.name.startswith("zero_pp_rank_") else 0
        if owner == rank:
            out.append(p)
    return out


def _baseline_save(engine: Any, client: Any, prefix: str, rank: int) -> dict[str, Any]:
    """``save_checkpoint`` to a local folder, then this rank's files checksummed and uploaded; rank 0 commits."""
    import torch.distributed as dist

    local = Path(os.environ["SG_DS_LOCAL"])
    t0 = time.perf_counter()
    engine.save_checkpoint(str(local), tag="baseline")
    t_saved = time.perf_counter()
    mine, sums, t_sum = _mine(local, rank), {}, 0.0
    size = sum(p.stat().st_size for p in mine)
    for p in mine:
        key = f"{prefix}/{p.relative_to(local).as_posix()}"
        a = time.perf_counter()
        sums[key] = _checksum(p)
        t_sum += time.perf_counter() - a
        client.upload_file(str(p), BUCKET, key)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sums)
    if rank == 0:
        record = {k: v for d in every for k, v in d.items()}
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/COMMIT.json", Body=json.dumps(record).encode())
    dist.barrier()  # every rank knows the commit is there
    t1 = time.perf_counter()
    return {"save_local_s": round(t_saved - t0, 4), "checksum_s": round(t_sum, 4), "bytes": size,
            "upload_s": round(t1 - t_saved - t_sum, 4), "files": len(mine)}


def _profile_save(hook: Any, rank: int, path: str) -> None:
    import cProfile
    import pstats

    orig = hook._save

    def save(*a: Any, **k: Any) -> Any:
        prof = cProfile.Profile()
        try:
            return prof.runcall(orig, *a, **k)
        finally:
            if rank == 0:
                with open(path, "w") as f:
                    pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(45)

    hook._save = save


def _trial_worker() -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from spotguard import install_preemption_hook

    stage, mib = int(os.environ["SG_DS_STAGE"]), float(os.environ["SG_DS_STATE_MIB"])
    period, sock = float(os.environ["SG_DS_ITER_S"]), os.environ["SPOTGUARD_SOCKET"]
    phase_b, phase_s = float(os.environ["SG_DS_PHASE_BASELINE"]), float(os.environ["SG_DS_PHASE_SPOTGUARD"])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, dim = _engine(stage, mib)
    loader = _stateful_loader(dim)
    hook = install_preemption_hook(engine, os.environ["SG_DS_STORAGE"])
    hook.add_state("data", loader)
    if os.environ.get("SG_DS_PROFILE"):  # debugging: cProfile of the hook's save, rank 0
        _profile_save(hook, rank, os.environ["SG_DS_PROFILE"])
    assert hook.resume() == 0
    client = _client()  # built before any clock starts, as bench_storage's baseline A
    flag = torch.zeros(1)
    done = [0]

    def iteration(sleep_s: float) -> None:
        busy(sleep_s)
        loss = engine(next(loader)).square().mean()
        engine.backward(loss)
        engine.step()
        done[0] += 1

    real = calibrate(iteration, True)
    period = max(period, real + 0.2)  # a real part longer than the cell's period: the iteration is it
    sleep_s = max(0.0, period - real)
    info: dict[str, Any] = {"real_part_s": round(real, 4), "sleep_s": round(sleep_s, 4),
                            "period_s": round(period, 4)}

    # 1. the baseline: a flag at a random phase, agreed after each step, then save + upload + commit
    t_flag = [0.0]

    def raise_flag(t_iter: float) -> None:
        time.sleep(max(0.0, t_iter + phase_b * period - time.time()))
        t_flag[0] = time.perf_counter()
        flag.fill_(1.0)

    if rank == 0:
        threading.Thread(target=raise_flag, args=(time.time(),), daemon=True).start()
    for _ in range(1 + AFTER):
        iteration(sleep_s)
        seen = flag.clone()
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if seen[0] > 0:
            t_agreed = time.perf_counter()
            break
    else:
        _emit(TRIAL_PREFIX, {"error": "the baseline's flag was never agreed"})
        sys.exit(3)
    base = _baseline_save(engine, client, os.environ["SG_DS_BASELINE_PREFIX"], rank)
    if rank == 0:
        base["notice_to_committed_s"] = round(time.perf_counter() - t_flag[0], 4)
        base["notice_to_agreed_s"] = round(t_agreed - t_flag[0], 4)  # the rest of the iteration: the boundary
        base["committed_step"] = done[0]
    sizes = [None] * world
    dist.all_gather_object(sizes, base["bytes"])
    base["bytes"] = sum(sizes)  # type: ignore[arg-type]
    if rank == 0:  # every rank is past its upload (the all_gather): the local copy goes
        shutil.rmtree(Path(os.environ["SG_DS_LOCAL"]) / "baseline", ignore_errors=True)
    if rank == 0:
        _emit(TRIAL_PREFIX, {"baseline": base})
    for _ in range(GAP):
        iteration(sleep_s)

    # 2. spotguard: a drill through the daemon at a random phase of the next iteration
    if rank == 0:
        _wait_subscribed(sock, world)
    dist.barrier()
    if rank == 0:
        drill_at(sock, phase_s * period, info, done)
    for _ in range(1 + AFTER):
        iteration(sleep_s)
    _emit(TRIAL_PREFIX, {"error": f"rank {rank} still training {AFTER} iterations after the notice"})
    sys.exit(3)


# ----------------------------------------------------------------------------------------- driver

def _trial(sock: str, work: Path, n: int, stage: int, mib: float, period: float,
           rng: random.Random) -> dict[str, Any]:
    """One job: a baseline trial, then a spotguard trial, each at its own random phase."""
    phase_b, phase_s = rng.random(), rng.random()
    local = Path(tempfile.mkdtemp(prefix="ds-local-", dir=work))
    env = {"SG_DS_STAGE": str(stage), "SG_DS_STATE_MIB": str(mib), "SG_DS_ITER_S": str(period),
           "SG_DS_PHASE_BASELINE": repr(phase_b), "SG_DS_PHASE_SPOTGUARD": repr(phase_s),
           "SG_DS_STORAGE": f"s3://{BUCKET}/sg/z{stage}-{mib:g}-{n}",
           "SG_DS_BASELINE_PREFIX": f"baseline/z{stage}-{mib:g}-{n}", "SG_DS_LOCAL": str(local),
           "SPOTGUARD_SOCKET": sock}
    rc, text = _torchrun("trial", env, timeout=240 + 15 * period + mib / 5,
                         script=Path(__file__))
    shutil.rmtree(local, ignore_errors=True)
    if os.environ.get("SG_DS_JOB_LOG"):  # debugging: the last job's whole output
        Path(os.environ["SG_DS_JOB_LOG"]).write_text(text)
    info: dict[str, Any] = {}
    base: dict[str, Any] = {}
    for d in _prefixed(text, TRIAL_PREFIX):
        if "baseline" in d:
            base = d["baseline"]
        else:
            info.update(d)
    if info.get("notice_id"):
        _cancel(sock, info["notice_id"])
    sg: dict[str, Any] = {"phase": round(phase_s, 4), "torchrun_rc": rc, **{
        k: info[k] for k in ("real_part_s", "sleep_s", "period_s", "completed_at_send") if k in info}}
    hook = [e for e in json_lines(text) if e.get("component") == "hook"]
    t_seen = hook_figures(sg, hook, info, text)
    mine = [e for e in hook if e.get("notice_id") == info.get("notice_id")]
    committed = [e for e in mine if e.get("event") == "checkpoint_committed"]
    agreed = [log_time(e) for e in mine if e.get("event") == "agreed"]
    if committed and "bytes" in committed[0]:
        sg["bytes"] = committed[0]["bytes"]
    if t_seen is not None and agreed:  # the profile: waiting for the step's end, then the save and commit
        sg["notice_to_agreed_s"] = round(max(agreed) - t_seen, 4)
        sg["agreed_to_committed_s"] = round(sg["notice_to_committed_s"] - sg["notice_to_agreed_s"], 4)
    out: dict[str, Any] = {"spotguard": sg, "baseline": {"phase": round(phase_b, 4), **base}}
    if not base:
        out["baseline"]["error"] = "no baseline result"
        out["baseline"]["tail"] = text[-3000:]
    if "notice_to_committed_s" in sg and "notice_to_committed_s" in base:
        out["speedup"] = round(base["notice_to_committed_s"] / sg["notice_to_committed_s"], 2)
    return out


def _cell(sock: str, work: Path, stage: int, mib: float, period: float, trials: int,
          rng: random.Random) -> dict[str, Any]:
    runs = []
    for i in range(trials):
        r = _trial(sock, work, i, stage, mib, period, rng)
        r["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        runs.append(r)
        print(json.dumps({"cell": f"zero{stage}/{mib:g}MiB", "trial": i,
                          **{m: {k: v for k, v in r[m].items() if k != "tail"} for m in ("spotguard", "baseline")},
                          "speedup": r.get("speedup"), "load_avg": r["load_avg"]}), flush=True)
    sg = [r["spotguard"]["notice_to_committed_s"] for r in runs if "notice_to_committed_s" in r["spotguard"]]
    bl = [r["baseline"]["notice_to_committed_s"] for r in runs if "notice_to_committed_s" in r["baseline"]]
    cell: dict[str, Any] = {
        "zero_stage": stage, "state_mib": mib, "iteration_s": period, "trials": trials,
        "failed": {"spotguard": trials - len(sg), "baseline": trials - len(bl)},
        "spotguard_notice_to_committed_s": _summary(sg),
        "spotguard_sent_to_committed_s": _summary([r["spotguard"]["sent_to_committed_s"] for r in runs
                                                   if "sent_to_committed_s" in r["spotguard"]]),
        "baseline_notice_to_committed_s": _summary(bl),
        "baseline_without_checksum_s": _summary([r["baseline"]["notice_to_committed_s"] - r["baseline"]["checksum_s"]
                                                 for r in runs if "notice_to_committed_s" in r["baseline"]]),
        "spotguard_notice_to_agreed_s": _summary([r["spotguard"]["notice_to_agreed_s"] for r in runs
                                                  if "notice_to_agreed_s" in r["spotguard"]]),
        "spotguard_agreed_to_committed_s": _summary([r["spotguard"]["agreed_to_committed_s"] for r in runs
                                                     if "agreed_to_committed_s" in r["spotguard"]]),
        "baseline_notice_to_agreed_s": _summary([r["baseline"]["notice_to_agreed_s"] for r in runs
                                                 if "notice_to_agreed_s" in r["baseline"]]),
        "baseline_save_local_s": _summary([r["baseline"]["save_local_s"] for r in runs
                                           if "save_local_s" in r["baseline"]]),
        "baseline_upload_s": _summary([r["baseline"]["upload_s"] for r in runs if "upload_s" in r["baseline"]]),
        "per_trial_speedup": _summary([r["speedup"] for r in runs if "speedup" in r]),
        "runs": runs,
    }
    if sg and bl:
        cell["speedup_p50"] = round(statistics.median(bl) / statistics.median(sg), 2)
        cell["meets_target_2x"] = cell["speedup_p50"] >= 2.0
    if mib <= 64 and sg:
        cell["meets_target_p99_1s"] = cell["spotguard_notice_to_committed_s"]["p99"] <= 1.0
    return cell


def _sink_env(port: int) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "SPOTGUARD_S3_SIGN_PAYLOAD": "0"}


def bench(cells: list[tuple[int, float, float, int]], *, seed: int, partial: Optional[Path] = None) -> dict[str, Any]:
    """Every cell, trials one job each; with ``partial``, what is done so far is written there after each cell."""
    from benchmarks.s3sink import spawn
    from spotguard.launch import start_daemon

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="sg-dstts-"))
    sock = str(work / "sg.sock")
    port = free_port()
    os.environ.update(_sink_env(port))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    sink = spawn(port, str(REPO))
    daemon = start_daemon(sock, cloud="none", log_path=work / "daemon.log")
    t0 = time.monotonic()
    try:
        _client().create_bucket(Bucket=BUCKET)
        import deepspeed

        out: dict[str, Any] = {
            "what": "DeepSpeed ZeRO, 2 ranks torchrun gloo CPU: notice -> committed at a uniformly random phase of an "
                    "iteration, spotguard's hook (notice_seen -> checkpoint_committed, hook log timestamps) vs "
                    "engine.save_checkpoint to a local folder + checksum + boto3 upload_file of each rank's files + "
                    "commit marker (flag raised -> marker put); one job per trial pair, baseline first",
            "storage": "benchmarks/s3sink.py (S3 over loopback, bodies discarded), payload signing off for both",
            "integrity": "both: spotguard's block CRC32C of every file (the baseline in a pass before each upload; "
                         "baseline_without_checksum_s subtracts it)",
            "deepspeed": deepspeed.__version__, "cpus": os.cpu_count(), "deadline_s": DEADLINE_S, "seed": seed,
            "load_avg_start": [round(x, 2) for x in os.getloadavg()], "cells": [],
        }
        for stage, mib, period, trials in cells:
            out["cells"].append(_cell(sock, work, stage, mib, period, trials, rng))
            out["cells"][-1]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({**out, "partial": True}, indent=2) + "\n")
        out["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        out["wall_s"] = round(time.monotonic() - t0, 1)
        return out
    finally:
        daemon.stop()
        sink.terminate()
        sink.wait(15)
        shutil.rmtree(work, ignore_errors=True)


def _parse_cells(spec: str) -> list[tuple[int, float, float, int]]:
    out = []
    for part in spec.split(","):
        stage, mib, secs, n = part.split(":")
        out.append((int(stage), float(mib), float(secs), int(n)))
    return out


def run() -> dict[str, Any]:
    """``python -m benchmarks deepspeed_time_to_safe``: the full set."""
    return bench(CELLS, seed=29)


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the daemon, the sink and the job end too
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: ZeRO-2, 4 MiB, one trial pair")
    ap.add_argument("--cells", help="STAGE:MIB:SECONDS:TRIALS,... (default: ZeRO-2/3 x 64 MiB/1 GiB)")
    ap.add_argument("--label", default="latest", help="results file: deepspeed_time_to_safe-<label>.json")
    ap.add_argument("--out", help="results file (default benchmarks/results/deepspeed_time_to_safe-<label>.json)")
    ap.add_argument("--seed", type=int, default=29)
    a = ap.parse_args(argv)
    cells = _parse_cells(a.cells) if a.cells else (QUICK_CELLS if a.quick else CELLS)
    path = Path(a.out) if a.out else RESULTS / f"deepspeed_time_to_safe-{a.label}.json"
    result = bench(cells, seed=a.seed, partial=path)
    result.update(label=a.label, quick=a.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("zero_stage", "state_mib", "failed", "spotguard_notice_to_committed_s", "baseline_notice_to_committed_s",
            "speedup_p50", "meets_target_2x", "meets_target_p99_1s")
    print(json.dumps({"cells": [{k: c[k] for k in keys if k in c} for c in result["cells"]], "results": str(path)},
                     indent=2))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _trial_worker()
    else:
        sys.exit(main(sys.argv[1:]))
