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

``--fsdp2 GBIT`` (issue 26 part 2): the model is ``fully_shard``-ed instead (every byte unique: B's half is its
own), storage is ``benchmarks/s3sink.py`` limited to ``GBIT`` Gbit/s for both nodes together (one node's
link), the notice's deadline is ``--grace`` s, and the arms are B writing its shards itself
(``SPOTGUARD_EVACUATE=never``) vs evacuating them to A's memory (``always``); rows add B's evacuation time
and bytes and A's receive/upload time.

``python -m benchmarks.doomed_plan [--cells 64,1024] [--trials 10] [--label NAME] [--fsdp2 GBIT --grace S]``
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, Iterator, Optional

if __package__ in (None, ""):  # run as a script by torchrun: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import free_port, json_lines, log_time, wait_port

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


def _worker_fsdp2(mib: int, store: str) -> None:
    """One rank: ``LAYERS`` Linear layers holding ``mib`` MiB, each ``fully_shard``-ed over both ranks (so each
    rank's half is unique), SGD on the last one only (short iterations), until the notice's exit. Node A (rank
    0) gets no notice: its SIGTERM from the launcher (once B left) leaves it torchrun's default 30 s, not B's
    deadline (``SPOTGUARD_SIGNAL_GRACE`` is B's notice here, sent as SIGUSR1)."""
    if os.environ.get("RANK") != "1":
        os.environ["SPOTGUARD_SIGNAL_GRACE"] = "30"  # read when spotguard is imported, below
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spotguard import install_preemption_hook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dim = max(8, int((mib * 2**20 / 4 / LAYERS) ** 0.5))
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])
    for layer in list(net)[:-1]:
        layer.weight.requires_grad_(False)
    for layer in net:
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    hook = install_preemption_hook({"model": model, "optimizer": opt}, storage=store)
    x = torch.randn(4, dim)
    for _ in range(10_000):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        print(json.dumps({"iter": 1}), flush=True)
        time.sleep(0.1)
    hook.close()


def trial(mib: int, plan: str, work: Path, sink: Optional[dict[str, str]] = None,
          grace: float = 30.0) -> dict[str, Any]:
    """One job: notice to rank 1 after 6 iterations; the row of timings read from its log. ``plan``: stock or
    survivors (DDP), or with ``sink`` (the S3 sink's environment) direct or evacuate (FSDP2)."""
    fsdp2 = sink is not None
    store = f"s3://bench/run-{time.monotonic_ns()}" if fsdp2 else Path(tempfile.mkdtemp(prefix="store-", dir=work))
    log = work / f"job-{mib}-{plan}-{time.monotonic_ns()}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "SPOTGUARD_SURVIVORS_PLAN": "0" if plan == "stock" else "1",
           "SPOTGUARD_EVACUATE": "always" if plan == "evacuate" else "never",
           "SPOTGUARD_SIGNAL_GRACE": str(grace),
           "SPOTGUARD_SOCKET": str(work / "no-daemon.sock"), **(sink or {})}
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", __file__,
                                 "--worker-fsdp2" if fsdp2 else "--worker", str(mib), str(store)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(work), start_new_session=True)
    row: dict[str, Any] = {"mib": mib, "plan": plan}
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
    if fsdp2:
        row["b_deadline_s"] = grace
        left = [e for e in ev if e.get("event") == "exit" and e.get("rank") == 1]
        if seen and left:  # B's exit (at its deadline at the latest), and whether it saw the commit itself
            row.update(b_exit=round(log_time(left[0]) - log_time(seen[0]), 4), b_code=left[0].get("code"))
    if fsdp2 and seen and safe and not done:  # B safe (evacuated) but nothing committed: the survivors' writes
        row.update(b_safe=round(log_time(safe[0]) - log_time(seen[0]), 4), committed=False,  # are bounded by B's
                   b_safe_in_save=safe[0].get("seconds"), evac_bytes=safe[0].get("evacuated_bytes"))  # deadline
        return row
    if not (seen and safe and done and (fsdp2 or len(done) == 2)):  # B may leave before the survivors' commit
        row["error"] = f"seen {len(seen)} safe {len(safe)} committed {len(done)}"
        return row
    t = log_time(seen[0])
    writers = next((e["writers"] for e in done if e.get("writers")), {})
    row.update(b_safe=round(log_time(safe[0]) - t, 4), b_safe_in_save=safe[0].get("seconds"), commit=round(max(log_time(e) for e in done) - t, 4),
               b_bytes=(writers.get("bytes_per_rank") or [0, 0])[1], a_bytes=(writers.get("bytes_per_rank") or [0])[0],
               record_plan=writers.get("plan"), step=done[0].get("step"), rc=proc.returncode, committed=True)
    moved = [e for e in ev if e.get("event") == "checkpoint_evacuated" and e.get("rank") == 1]
    got = [e for e in ev if e.get("event") == "checkpoint_evacuation_received" and e.get("rank") == 0]
    if moved and got:  # B's stream to A's memory (acknowledged), then A's upload of it
        row.update(evac_bytes=moved[0]["bytes"], evac_seconds=moved[0]["seconds"],
                   a_receive_seconds=got[0]["receive_seconds"], a_upload_seconds=got[0]["upload_seconds"],
                   record_evacuated=writers.get("evacuated"))
    return row


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mib in sorted({r["mib"] for r in rows}):
        for plan in ("stock", "survivors", "direct", "evacuate"):
            ok = [r for r in rows if r["mib"] == mib and r["plan"] == plan and "error" not in r and "commit" in r]
            cell = [r for r in rows if r["mib"] == mib and r["plan"] == plan]
            if not cell:
                continue
            out[f"{mib}MiB/{plan}"] = {"trials": len(cell), "failed": len(cell) - len(ok),
                                       "b_safe_count": sum(1 for r in cell if "b_safe" in r)}
            safe = [r["b_safe"] for r in cell if "b_safe" in r]
            if safe:  # also a trial where B was safe but the survivors could not commit before B's deadline
                out[f"{mib}MiB/{plan}"].update(b_safe_p50=round(statistics.median(safe), 3),
                                               b_safe_p99=round(_pct(safe, 0.99), 3))
            if not ok:
                continue
            commit = [r["commit"] for r in ok]
            exits = [r["b_exit"] for r in cell if "b_exit" in r]
            if exits:  # B's exit after its notice (the deadline binds it), and the commits landing after it
                out[f"{mib}MiB/{plan}"].update(b_exit_max=round(max(exits), 3), commits_after_b_deadline=sum(
                    1 for r in ok if r["commit"] > r.get("b_deadline_s", float("inf"))))
            out[f"{mib}MiB/{plan}"].update(
                commit_p50=round(statistics.median(commit), 3), commit_p99=round(_pct(commit, 0.99), 3),
                b_bytes_median=int(statistics.median(r["b_bytes"] for r in ok)))
            evac = [r for r in ok if r.get("evac_seconds")]
            if evac:  # the wire rate B -> A's memory, and A's upload of what it received
                out[f"{mib}MiB/{plan}"].update(
                    evac_bytes_median=int(statistics.median(r["evac_bytes"] for r in evac)),
                    evac_gib_s_p50=round(statistics.median(r["evac_bytes"] / r["evac_seconds"] for r in evac) / 2**30, 3),
                    a_upload_s_p50=round(statistics.median(r["a_upload_seconds"] for r in evac), 3))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="64,1024", help="state sizes in MiB, comma-separated")
    ap.add_argument("--trials", type=int, default=10, help="trials per plan and size")
    ap.add_argument("--label", default=datetime.now().strftime("%Y-%m-%d"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--fsdp2", type=float, default=None, metavar="GBIT",
                    help="FSDP2 arm: storage = the S3 sink limited to GBIT Gbit/s; B writes vs B evacuates")
    ap.add_argument("--grace", type=float, default=30.0, help="the notice's deadline in s (FSDP2 arm)")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    plans = ("direct", "evacuate") if args.fsdp2 is not None else ("stock", "survivors")
    with tempfile.TemporaryDirectory(prefix="doomed-plan-") as tmp, _sink(args.fsdp2) as sink:
        work = Path(tmp)
        for mib in [int(c) for c in args.cells.split(",")]:
            for i in range(args.trials):
                for plan in (plans if i % 2 == 0 else plans[::-1]):
                    row = trial(mib, plan, work, sink, args.grace)
                    row["trial"] = i
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    for d in work.glob("store-*"):  # one trial's checkpoint at a time on disk
                        subprocess.run(["rm", "-rf", str(d)], check=False)
    doc = {"benchmark": "doomed_plan", "label": args.label, "layers": LAYERS, "summary": summarize(rows),
           "link_gbit": args.fsdp2, "grace_s": args.grace if args.fsdp2 is not None else 30.0,
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"doomed_plan-{args.label}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


@contextlib.contextmanager
def _sink(gbit: Optional[float]) -> Iterator[Optional[dict[str, str]]]:
    """The S3 sink limited to ``gbit`` Gbit/s (None: no sink, local folders) and the workers' environment."""
    if gbit is None:
        yield None
        return
    import boto3  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port), "--gbit", str(gbit)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                     aws_secret_access_key="bench", region_name="us-east-1",
                     config=Config(s3={"addressing_style": "path"})).create_bucket(Bucket="bench")
        yield env
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--worker-fsdp2":
        _worker_fsdp2(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(main())
