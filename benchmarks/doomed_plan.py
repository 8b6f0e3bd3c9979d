"""Notice to one node only: when is the doomed node safe, today's plan vs the notice-aware one (issue 26).

Each trial is one real ``torchrun`` job (2 ranks, gloo, CPU; rank 0 stands for
node A, rank 1 for node B) training a DDP model whose state is ``MIB`` MiB
(``LAYERS`` square ``Linear`` layers, plain SGD: the state is the parameters;
only the last layer trains, so an iteration stays short at 1 GiB on 2 cores),
under ``install_preemption_hook`` writing to a fresh local folder. After a few
iterations the driver sends SIGUSR1 to rank 1 only (a preemption notice on node
B, deadline ``SPOTGUARD_SIGNAL_GRACE`` = 30 s); the job commits and exits. Read
from the hook's own JSON lines (``timestamp``, one host clock):

- ``b_safe``: B's ``notice_seen`` -> B's ``checkpoint_safe`` (its own bytes
  durable; the line is logged whichever plan runs); ``b_safe_in_save``: the same
  from the save's start (the rest is the agreement and the end of the iteration);
- ``commit``: B's ``notice_seen`` -> the latest ``checkpoint_committed``;
- ``b_bytes``: what B wrote (the commit record's ``writers.bytes_per_rank``).

The two plans alternate trial by trial in the same run (``SPOTGUARD_SURVIVORS_PLAN=0``: DCP's stock plan,
today's path; ``1``: replicated items to the survivors). Results: ``benchmarks/results/doomed_plan-<label>.json``
with every trial's raw row.

``python -m benchmarks.doomed_plan [--cells 64,1024] [--trials 10] [--label NAME]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script by torchrun: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import json_lines, log_time

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
LAYERS = 8


def _worker(mib: int, store: str) -> None:
    """One rank: DDP over LAYERS Linear layers holding ``mib`` MiB, SGD, until the notice's exit."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spotguard import install_preemption_hook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dim = max(8, int((mib * 2**20 / 4 / LAYERS) ** 0.5))
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])
    for p in list(net.parameters())[:-1]:
        p.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    hook = install_preemption_hook({"model": model, "optimizer": opt}, storage=store)
    x = torch.randn(4, dim)
    for _ in range(10_000):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(json.dumps({"iter": 1}), flush=True)
        time.sleep(0.1)
    hook.close()


def trial(mib: int, survivors: bool, work: Path) -> dict[str, Any]:
    """One job: notice to rank 1 after 3 iterations; the row of timings read from its log."""
    store = Path(tempfile.mkdtemp(prefix="store-", dir=work))
    log = work / f"job-{mib}-{int(survivors)}-{time.monotonic_ns()}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "SPOTGUARD_SURVIVORS_PLAN": "1" if survivors else "0",
           "SPOTGUARD_SOCKET": str(work / "no-daemon.sock")}
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", __file__, "--worker",
                                 str(mib), str(store)], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                start_new_session=True)
    row: dict[str, Any] = {"mib": mib, "plan": "survivors" if survivors else "stock"}
    try:
        pid = None
        while time.monotonic() - t0 < 120:
            ev = json_lines(log.read_text(errors="replace"))
            inst = [e for e in ev if e.get("event") == "hook_installed" and e.get("rank") == 1]
            if inst and sum(1 for e in ev if e.get("iter")) >= 6:
                pid = int(inst[0]["pid"])
                break
            if proc.poll() is not None:
                break
            time.sleep(0.05)  # polling a child's log file: nothing to await
        if pid is None:
            row["error"] = "job did not start"
            return row
        os.kill(pid, signal.SIGUSR1)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ev = [e for e in json_lines(log.read_text(errors="replace")) if e.get("component") == "hook"]
    seen = [e for e in ev if e.get("event") == "notice_seen" and e.get("rank") == 1]
    safe = [e for e in ev if e.get("event") == "checkpoint_safe" and e.get("rank") == 1]
    done = [e for e in ev if e.get("event") == "checkpoint_committed"]
    if not (seen and safe and len(done) == 2):
        row["error"] = f"seen {len(seen)} safe {len(safe)} committed {len(done)}"
        return row
    t = log_time(seen[0])
    writers = done[0].get("writers") or {}
    row.update(b_safe=round(log_time(safe[0]) - t, 4), b_safe_in_save=safe[0].get("seconds"), commit=round(max(log_time(e) for e in done) - t, 4),
               b_bytes=(writers.get("bytes_per_rank") or [0, 0])[1], a_bytes=(writers.get("bytes_per_rank") or [0])[0],
               record_plan=writers.get("plan"), step=done[0].get("step"), rc=proc.returncode)
    return row


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mib in sorted({r["mib"] for r in rows}):
        for plan in ("stock", "survivors"):
            ok = [r for r in rows if r["mib"] == mib and r["plan"] == plan and "error" not in r]
            if not ok:
                continue
            safe, commit = [r["b_safe"] for r in ok], [r["commit"] for r in ok]
            out[f"{mib}MiB/{plan}"] = {
                "trials": len(ok), "failed": sum(1 for r in rows if r["mib"] == mib and r["plan"] == plan) - len(ok),
                "b_safe_p50": round(statistics.median(safe), 3), "b_safe_p99": round(_pct(safe, 0.99), 3),
                "commit_p50": round(statistics.median(commit), 3), "commit_p99": round(_pct(commit, 0.99), 3),
                "b_bytes_median": int(statistics.median(r["b_bytes"] for r in ok))}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="64,1024", help="state sizes in MiB, comma-separated")
    ap.add_argument("--trials", type=int, default=10, help="trials per plan and size")
    ap.add_argument("--label", default=datetime.now().strftime("%Y-%m-%d"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="doomed-plan-") as tmp:
        work = Path(tmp)
        for mib in [int(c) for c in args.cells.split(",")]:
            for i in range(args.trials):
                for survivors in ((False, True) if i % 2 == 0 else (True, False)):
                    row = trial(mib, survivors, work)
                    row["trial"] = i
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    for d in work.glob("store-*"):  # one trial's checkpoint at a time on disk
                        subprocess.run(["rm", "-rf", str(d)], check=False)
    doc = {"benchmark": "doomed_plan", "label": args.label, "layers": LAYERS, "summary": summarize(rows),
           "rows": rows}
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"doomed_plan-{args.label}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(main())
