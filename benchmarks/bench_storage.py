"""Emergency-checkpoint upload: spotguard vs two hand-written baselines, on one S3-compatible sink.

Per state size (GiB of model + optimizer state, replicated on 2 gloo ranks as
with DDP), each method runs once to warm up and once timed, against the same
``benchmarks/s3sink.py`` (accepts uploads, discards bodies: it measures the
uploader, not a server):

- ``spotguard``: ``dcp.save`` with ``S3Storage.dcp_writer`` (parallel multipart
  from pooled buffers; each replicated tensor written once, spread over ranks),
  then the commit record;
- ``A``: rank 0 ``torch.save`` to local disk, then boto3 ``upload_file``;
- ``B``: ``dcp.save`` with ``FsspecWriter`` over s3fs.

Reported: notice→commit seconds (rank 0, barrier to barrier), node throughput,
peak extra RSS per rank during the save (sampled every 5 ms), and a raw
loopback TCP stream to the sink's discard port in the same run (the ceiling).

    python -m benchmarks bench_storage          # sizes from $SPOTGUARD_BENCH_SIZES (GiB, default "1")
    python -m benchmarks.bench_storage --sizes 1,4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

GiB = 1024 ** 3
REPO = Path(__file__).resolve().parents[1]
TENSOR_BYTES = 64 * 1024 * 1024  # state made of 64 MiB tensors (large layers + Adam moments)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS every 5 ms; ``extra`` = peak - RSS at start."""

    def __init__(self) -> None:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *a: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


# --- one rank ----------------------------------------------------------------------


def _state(size: int) -> dict[str, Any]:
    import torch

    n = max(1, size // TENSOR_BYTES)
    model, optim = {}, {}
    for i in range(n):
        t = torch.empty(TENSOR_BYTES // 4, dtype=torch.float32).fill_(float(i))  # touched: resident
        (model if i % 3 == 0 else optim)[f"t{i}"] = t
    return {"model": model, "optim": optim}


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=2)
    state = _state(int(a.size * GiB))
    nbytes = sum(t.nbytes for d in state.values() for t in d.values())
    bucket = "bench"
    results = []
    for it in range(2):  # warm-up, then timed
        tag = f"{a.method}-{a.size}-{it}"
        if a.method == "spotguard":
            from spotguard.storage import open_storage
            from spotguard.storage.commit import CommitRecord, commit, prepare_attempt

            storage = open_storage(f"s3://{bucket}/{tag}")
            if a.rank == 0:
                prepare_attempt(storage, 1)
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.monotonic()
            if a.method == "spotguard":
                dcp.save(state, storage_writer=storage.dcp_writer("step-00000001"))
                dist.barrier()
                if a.rank == 0:
                    commit(storage, 1, CommitRecord(step=1))
            elif a.method == "A":
                if a.rank == 0:
                    import boto3

                    path = f"/tmp/sg-bench-{os.getpid()}.pt"
                    torch.save(state, path)
                    c = boto3.client("s3")
                    c.upload_file(path, bucket, f"{tag}/state.pt")
                    c.put_object(Bucket=bucket, Key=f"{tag}/COMMIT", Body=b"{}")
                    os.unlink(path)
            else:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                w = FsspecWriter(f"s3://{bucket}/{tag}/step", sync_files=False,
                                 endpoint_url=os.environ["AWS_ENDPOINT_URL"])
                dcp.save(state, storage_writer=w)
                dist.barrier()
                if a.rank == 0:
                    import boto3

                    boto3.client("s3").put_object(Bucket=bucket, Key=f"{tag}/COMMIT", Body=b"{}")
            dist.barrier()
            t1 = time.monotonic()
        results.append({"seconds": t1 - t0, "extra_rss": mem.extra})
    out = {"rank": a.rank, "state_bytes": nbytes, "warmup": results[0], "timed": results[1]}
    Path(a.out).write_text(json.dumps(out))
    dist.destroy_process_group()


# --- driver -------------------------------------------------------------------------


def raw_stream(port: int, nbytes: int) -> float:
    """GiB/s of one TCP stream from a reused buffer to the sink's discard port."""
    buf = memoryview(bytearray(8 * 1024 * 1024))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(buf)  # warm-up
        t0 = time.monotonic()
        sent = 0
        while sent < nbytes:
            s.sendall(buf)
            sent += len(buf)
        dt = time.monotonic() - t0
    return sent / dt / GiB


def run_one(method: str, size: float, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    port = _free_port()
    procs = []
    for r in range(2):
        cmd = [sys.executable, "-m", "benchmarks.bench_storage", "--rank", str(r), "--method", method,
               "--size", str(size), "--port", str(port), "--out", str(tmp / f"{method}-{size}-{r}.json")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{method} {size} GiB failed:\n" + "\n".join(o[-3000:] for o in outs))
    ranks = [json.loads((tmp / f"{method}-{size}-{r}.json").read_text()) for r in range(2)]
    secs = ranks[0]["timed"]["seconds"]
    state = ranks[0]["state_bytes"]
    return {
        "notice_to_commit_s": round(secs, 3),
        "warmup_s": round(ranks[0]["warmup"]["seconds"], 3),
        "throughput_gib_s": round(state / secs / GiB, 3),
        "peak_extra_rss_gib_per_rank": [round(r["timed"]["extra_rss"] / GiB, 3) for r in ranks],
        "peak_extra_rss_x_state": round(max(r["timed"]["extra_rss"] for r in ranks) / state, 3),
    }


def run(sizes: list[float] | None = None) -> dict[str, Any]:
    import tempfile

    if sizes is None:
        sizes = [float(s) for s in os.environ.get("SPOTGUARD_BENCH_SIZES", "1").split(",") if s.strip()]
    port, raw_port = _free_port(), _free_port()
    sink = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port), "--raw-port",
                             str(raw_port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                   AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                   AWS_REQUEST_CHECKSUM_CALCULATION="when_required",  # same for every method
                   AWS_RESPONSE_CHECKSUM_VALIDATION="when_required",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_DEFAULT_REGION")})
        import boto3
        from botocore.config import Config

        boto3.client("s3", config=Config(s3={"addressing_style": "path"})).create_bucket(Bucket="bench")
        raw = raw_stream(raw_port, 4 * GiB)
        out: dict[str, Any] = {"cpus": os.cpu_count(), "raw_loopback_stream_gib_s": round(raw, 3), "sizes": {}}
        with tempfile.TemporaryDirectory() as td:
            for size in sizes:
                row: dict[str, Any] = {}
                for method in ("spotguard", "A", "B"):
                    try:
                        row[method] = run_one(method, size, env, Path(td))
                    except Exception as exc:  # noqa: BLE001 - report, keep the other figures
                        row[method] = {"error": str(exc)[-600:]}
                    print(f"{size} GiB {method}: {row[method]}", flush=True)
                sg = row["spotguard"].get("notice_to_commit_s")
                for base in ("A", "B"):
                    b = row[base].get("notice_to_commit_s")
                    if sg and b:
                        row[f"speedup_vs_{base}"] = round(b / sg, 2)
                if sg:
                    eff = row["spotguard"]["throughput_gib_s"] / raw
                    row["efficiency_vs_raw_stream"] = round(eff, 3)
                    # GB per node that fit in 25 s at a NIC of G Gbit/s, at this efficiency
                    row["projection_gb_in_25s"] = {f"{g}Gbit": round(eff * g / 8 * 25, 1) for g in (10, 25, 100)}
                out["sizes"][f"{size:g}GiB"] = row
        return out
    finally:
        sink.terminate()
        sink.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--method")
    ap.add_argument("--size", type=float)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    ap.add_argument("--sizes", default=None)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a)
        return
    sizes = [float(s) for s in a.sizes.split(",")] if a.sizes else None
    print(json.dumps(run(sizes), indent=2))


if __name__ == "__main__":
    main()
