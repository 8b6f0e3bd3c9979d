"""Peak extra host memory of an emergency save, per path (issue 22: target <= 64 MiB for 512 MiB of state).

A 2-rank ``torchrun`` job (gloo, CPU): a DDP model of 8 frozen square
``Linear(4096)`` layers (512 MiB of parameters) and a small trained head
(``Linear(4096, 8)``, plain SGD: no optimizer state, so the state is the
512 MiB), a scheduler, 1 s iterations (simulated compute plus a real step of
the head). After the warm-up a preemption is handed to rank 1 at a
uniformly random phase of an iteration; each rank samples its own RSS
(``/proc/self/statm``) every 2 ms from the start of that iteration until its
``hook.on_exit`` callback, and reports the peak above the RSS at that start
(rank 0 learns of the notice from the hook, so both ranks start there).
Storage: a local folder in a fresh temporary directory (page cache is not RSS).

Why a small trained head: the first version trained the last 64 MiB layer, and
its backward allocates 64 MiB (the new gradient, or with ``set_to_none=False``
a temporary summed into it) in every iteration; a save window that spans a
backward counted that allocation of the training loop as the save's. The
64-67 MiB first reported here were exactly that (``BENCH_TRACE=1`` shows the
RSS rising during ``loss.backward()`` and falling at ``zero_grad``, with or
without a notice), and rank 0 was never sampled (its figure, 0.0, meant
nothing). The loop also zeroes gradients in place.

``--layers N --width W`` change the model (``--layers 2 --width 8192``: the
same 512 MiB as two 256 MiB tensors, to show the figure does not follow the
largest tensor); ``BENCH_TRACE=1`` adds each rank's RSS trace with the loop's
phases to the JSON.

Paths, each its own job, interleaved over ``--rounds``:
- ``any-moment``: the default (the background agreement, the watch proves the
  live tensors are those of step S, the save reads them without a copy);
- ``fallback``: ``SPOTGUARD_WATCH_PARAM_DATA=0`` (nothing can be proven: the
  training thread reads the state at its next ``optimizer.step()``);
- ``boundary``: ``SPOTGUARD_BACKGROUND_AGREEMENT=0`` (the step-boundary path);
- ``rebalance``: an ordinary checkpoint (training goes on, so the background
  save copies the state: the bounded, documented cost).

``python -m benchmarks.bench_emergency_memory [--rounds N] [--layers N --width W]`` writes
``benchmarks/results/bench_emergency_memory.json`` (``..._<layers>x<width>.json``
for another model); ``make bench`` runs it with 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script by torchrun: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import REPO, busy  # noqa: E402

PATHS: dict[str, dict[str, str]] = {
    "any-moment": {},
    "fallback": {"SPOTGUARD_WATCH_PARAM_DATA": "0"},
    "boundary": {"SPOTGUARD_BACKGROUND_AGREEMENT": "0"},
    "rebalance": {"BENCH_NOTICE_KIND": "rebalance"},
}
LAYERS, WIDTH = int(os.environ.get("BENCH_LAYERS", 8)), int(os.environ.get("BENCH_WIDTH", 4096))  # 8 x 64 MiB fp32
HEAD = 8  # outputs of the trained head (WIDTH x 8 fp32: 128 KiB with the default width)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)],
                              torch.nn.Linear(WIDTH, HEAD, bias=False))
    for p in list(net.parameters())[:-1]:
        p.requires_grad_(False)  # only the small head trains: the compute stays small on 2 cores, and
        # the loop's own allocations (gradients, autograd temporaries) stay small next to the save's
    model = DDP(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1e-6)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    out_dir = Path(os.environ["BENCH_OUT"])
    kind = os.environ.get("BENCH_NOTICE_KIND", "preemption")
    hook = install_preemption_hook({"model": model, "optimizer": opt, "scheduler": sched},
                                   storage=os.environ["BENCH_STORE"], socket="/nonexistent/spotguard.sock")
    hook.resume()
    peak = [0]
    base = [0]
    sampling = threading.Event()

    trace: list[tuple[float, float, str]] = []
    tracing = os.environ.get("BENCH_TRACE") == "1"
    t0 = time.monotonic()

    def mark(what: str) -> None:
        if tracing:
            trace.append((round(time.monotonic() - t0, 4), round(_rss() / 2**20, 1), what))

    def sample() -> None:
        while True:
            if sampling.is_set():
                r = _rss()
                peak[0] = max(peak[0], r)
                if tracing:
                    trace.append((round(time.monotonic() - t0, 4), round(r / 2**20, 1), ""))
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()

    def report(code: int, committed: bool) -> None:
        sampling.clear()
        (out_dir / f"rank{rank}.json").write_text(json.dumps({
            "extra_mib": round((peak[0] - base[0]) / 2**20, 1), "base_mib": round(base[0] / 2**20, 1),
            "code": code, "committed": committed, **({"trace": trace} if tracing else {})}))

    hook.on_exit(report)
    x = torch.randn(4, WIDTH)
    rng = random.Random(int(os.environ.get("BENCH_SEED", "0")))
    notice_iter, phase = 3, rng.random()

    def notify() -> None:
        mark("notice")
        now = utcnow()
        from datetime import timedelta

        hook.notify(Notice(id=f"bench-{kind}", source="drill", kind=kind, deadline=now + timedelta(seconds=30),
                           received_at=now))

    for i in range(12):
        if i == notice_iter and rank == 1:
            threading.Timer(phase * 1.0, notify).start()
        mark(f"iter {i}")
        if i == notice_iter:
            base[0] = peak[0] = _rss()
            sampling.set()
        busy(0.9)
        mark("forward")
        loss = model(x).pow(2).mean()
        mark("backward")
        loss.backward()
        mark("step")
        opt.step()
        sched.step()
        mark("zero_grad")
        opt.zero_grad(set_to_none=False)  # in place: the gradient is not allocated again each backward
        if kind == "rebalance" and i == notice_iter + 3:
            report(0, True)  # training went on: report here (the rebalance save is long committed)
            break
    dist.barrier()
    dist.destroy_process_group()


def one(path: str, seed: int) -> dict[str, Any]:
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory(prefix="sg-mem-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTGUARD_LOG_LEVEL": "warning", **PATHS[path],
               "BENCH_OUT": tmp, "BENCH_STORE": f"file://{tmp}/ckpt", "BENCH_SEED": str(seed),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__, "--worker"],
                              capture_output=True, text=True, env=env, timeout=300)
        ranks = {}
        for r in (0, 1):
            f = Path(tmp, f"rank{r}.json")
            if not f.exists():
                raise RuntimeError(f"{path}: rank {r} reported nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            ranks[r] = json.loads(f.read_text())
    return {"path": path, "seed": seed, "ranks": ranks}


def run(rounds: int = 2) -> dict[str, Any]:
    trials: list[dict[str, Any]] = []
    for k in range(rounds):
        order = list(PATHS) if k % 2 == 0 else list(reversed(PATHS))  # interleaved: drift hits every path
        for path in order:
            trials.append(one(path, seed=k))
    summary: dict[str, Any] = {}
    for path in PATHS:
        extra = [t["ranks"][r]["extra_mib"] for t in trials if t["path"] == path for r in (0, 1)]
        summary[path] = {"extra_mib_median": round(statistics.median(extra), 2), "extra_mib_max": max(extra),
                         "extra_mib_min": min(extra), "n": len(extra),
                         "all_committed": all(t["ranks"][r]["committed"] for t in trials if t["path"] == path
                                              for r in (0, 1))}
    return {"state_mib": LAYERS * WIDTH * WIDTH * 4 / 2**20, "layers": LAYERS, "width": WIDTH,
            "largest_tensor_mib": WIDTH * WIDTH * 4 / 2**20, "summary": summary, "trials": trials}


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--rounds", type=int, default=2)
        ap.add_argument("--layers", type=int, default=LAYERS)
        ap.add_argument("--width", type=int, default=WIDTH)
        args = ap.parse_args()
        os.environ["BENCH_LAYERS"], os.environ["BENCH_WIDTH"] = str(args.layers), str(args.width)
        LAYERS, WIDTH = args.layers, args.width
        res = run(args.rounds)
        name = "bench_emergency_memory" + ("" if (LAYERS, WIDTH) == (8, 4096) else f"_{LAYERS}x{WIDTH}")
        out = Path(__file__).parent / "results" / f"{name}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res["summary"], indent=2))
