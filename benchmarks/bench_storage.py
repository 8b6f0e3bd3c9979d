"""Emergency-checkpoint upload: spotguard vs two hand-written baselines and raw TCP, on one S3-compatible sink.

Per state size (GiB of model + optimizer state, replicated on 2 gloo ranks as
with DDP), against the same ``benchmarks/s3sink.py`` (accepts uploads, discards
bodies: it measures the uploader, not a server). Every figure is notice→commit:
rank 0, from a barrier before the save to the barrier after the commit record.

- ``spotguard``: what the hook does — ``dcp.save`` with ``S3Storage.dcp_writer``
  (parallel multipart parts sent straight from tensor memory; each replicated
  tensor written once, spread over ranks), barrier, commit record, barrier.
  One storage per run (the hook keeps one per job), each save the next step.
- ``A``: rank 0 ``torch.save`` to local disk, then boto3 ``upload_file``;
- ``B``: ``dcp.save`` with ``FsspecWriter`` over s3fs.

The reference (the ceiling) is raw TCP in the *same rank processes*, timed the
same way and interleaved with the uploads round by round (order rotating), so
both see the same machine: each rank sends its half of the state's bytes,
straight from the tensors' memory, in 4 MiB ``sendall``s, over acknowledged
streams to the sink's ``--ack-port`` (the receiver answers after the last
byte, as an upload's response does):

- ``raw1``: one stream per rank;
- ``rawN``: as many streams per rank as the uploader's connections
  (``$SPOTGUARD_UPLOAD_CONCURRENCY``, default 8);
- ``spotguard1``: the uploader itself limited to one connection per rank.

Efficiencies are medians of per-round ratios: ``efficiency_vs_raw1``
(spotguard / raw1), ``efficiency_vs_rawN`` (spotguard / rawN: same connections)
and ``efficiency_1conn_vs_raw1`` (spotguard1 / raw1). ``cpu_s_per_gib_*`` is
rank 0's CPU time (all threads) per GiB it sent. On a box with few cores,
connections cost CPU in the kernel and the sink, so raw1 > rawN there; on a
real VM each S3 connection carries ~85-90 MB/s and the uploader needs them.

Payload hashing: over plain http botocore SHA-256-hashes every request body
(its rule for connections without TLS); over https — what a real VM uses —
S3 requests go ``UNSIGNED-PAYLOAD`` and TLS protects the bytes. By default the
benchmark measures the https configuration minus TLS: payload signing off for
*every* method (spotguard via ``$SPOTGUARD_S3_SIGN_PAYLOAD=0``, baseline A via
boto3's ``payload_signing_enabled=False``, baseline B via s3fs's
``config_kwargs``). ``$SPOTGUARD_BENCH_SIGN=1`` signs every method instead.

    python -m benchmarks bench_storage          # sizes from $SPOTGUARD_BENCH_SIZES (GiB, default "1")
    python -m benchmarks.bench_storage --sizes 1,4
    $SPOTGUARD_BENCH_ROUNDS (default 7): interleaved timed rounds of spotguard and the references
    $SPOTGUARD_BENCH_REPS (default 5): fresh runs of A and B per size; min / median / max are reported
    $SPOTGUARD_BENCH_METHODS (default spotguard,A,B): which to run (spotguard alone: the checksum cost)
    $SPOTGUARD_BENCH_CHECKSUM_ONLY=1: the rounds interleave only spotguard and spotguard_nocrc
    $SPOTGUARD_BENCH_LINK_GBIT=G: the sink receives at most G Gbit/s (one node's NIC; s3sink --gbit)
    --out FILE: also write the raw results there (``benchmarks/results/`` keeps the ones docs quote)

spotguard's figures include its integrity work, inside the timed path: CRC32C block
checksums computed as the bytes stream out, S3 part checksums, the ranks' write reports
gathered for the commit record. ``spotguard_nocrc`` is the same save with the checksums
switched off (benchmark only), interleaved round by round, so
``checksum_share_of_notice_to_commit`` is what integrity costs. Baseline A keeps
torch.save's own CRC32 (its default) and builds its boto3 client before the clock starts.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from benchmarks._util import cpu_seconds, free_port, wait_port

GiB = 1024 ** 3
REPO = Path(__file__).resolve().parents[1]
RAW_CHUNK = 4 * 1024 * 1024  # the reference's send size, the uploader's too (SegmentReader.READ_CHUNK)
TENSOR_BYTES = 64 * 1024 * 1024  # state made of 64 MiB tensors (large layers + Adam moments)
ALL_KINDS = ["raw1", "rawN", "spotguard", "spotguard1", "spotguard_nocrc"]  # the interleaved rounds


def _sign() -> bool:
    return os.environ.get("SPOTGUARD_BENCH_SIGN", "") == "1"


def _boto_config() -> Any:
    from botocore.config import Config

    return Config(s3={"addressing_style": "path", "payload_signing_enabled": _sign()})


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


def _acked_send(sock: socket.socket, views: list[memoryview]) -> None:
    """One acked stream (``s3sink --ack-port``): length, the bytes in 4 MiB sends, wait for the ack."""
    sock.sendall(sum(len(v) for v in views).to_bytes(8, "big"))
    for v in views:
        for off in range(0, len(v), RAW_CHUNK):
            sock.sendall(v[off:off + RAW_CHUNK])
    if sock.recv(1) != b"k":
        raise RuntimeError("acked stream: no acknowledgement")


def raw_round(ack_port: int, tensors: list[Any], rank: int, conns: int) -> float:
    """The reference, timed like a save (barrier to barrier): this rank sends its half of the state's
    bytes, straight from the tensors' memory, over ``conns`` acknowledged TCP streams."""
    import torch.distributed as dist

    mine = [memoryview(t.numpy()).cast("B") for i, t in enumerate(tensors) if i % 2 == rank]
    lanes = [lane for lane in (mine[j::conns] for j in range(conns)) if lane]
    socks = [socket.create_connection(("127.0.0.1", ack_port)) for _ in lanes]
    errors: list[BaseException] = []

    def lane_main(sock: socket.socket, views: list[memoryview]) -> None:
        try:
            _acked_send(sock, views)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        dist.barrier()
        t0 = time.monotonic()
        threads = [threading.Thread(target=lane_main, args=(sk, ln)) for sk, ln in zip(socks, lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dist.barrier()
        t1 = time.monotonic()
    finally:
        for sk in socks:
            sk.close()
    if errors:
        raise errors[0]
    return t1 - t0


def spotguard_round(state: dict[str, Any], rank: int, storage: Any, step: int) -> tuple[float, int, float]:
    """One emergency save as the hook does it: DCP to the object store (CRC32C block checksums computed as
    the bytes stream out, S3 part checksums), barrier, the ranks' write reports gathered, commit, barrier.
    Returns (seconds, peak extra RSS, share of the whole machine's CPU time that was busy meanwhile)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from spotguard.hook.dist import gather_writes
    from spotguard.storage.commit import CommitRecord, commit, prepare_attempt, step_dir

    key = prepare_attempt(storage, step) if rank == 0 else step_dir(step)
    dist.barrier()
    with PeakRSS() as mem:
        busy0 = _cpu_ticks()
        t0 = time.monotonic()
        dcp.save(state, storage_writer=storage.dcp_writer(key))
        dist.barrier()
        written = gather_writes(dist.group.WORLD, storage.write_log.take(key))
        if rank == 0:
            commit(storage, step, CommitRecord(step=step), written)
        dist.barrier()
        t1 = time.monotonic()
        busy1 = _cpu_ticks()
    return t1 - t0, mem.extra, (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (``/proc/stat``): is there idle CPU
    during a save for a checksum to hide in?"""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


@contextlib.contextmanager
def _no_checksums() -> Iterator[None]:
    """For the ``spotguard_nocrc`` reference only: spotguard's CRC32C switched off, to measure what it costs."""
    from spotguard.storage import integrity, objstore

    C, U = integrity.Checksummer, objstore.Upload
    saved = (C.update, C.crc_of_span, C.digest, U.crc_of)
    C.update = lambda self, data: setattr(self, "size", self.size + memoryview(data).nbytes)  # type: ignore
    C.crc_of_span = lambda self, a, b: None  # type: ignore
    C.digest = lambda self: integrity.FileDigest(  # type: ignore
        self.size, "00000000" * integrity.FileDigest.block_count(self.size))
    U.crc_of = lambda self, n, d: "AAAAAA=="  # type: ignore
    try:
        yield
    finally:
        C.update, C.crc_of_span, C.digest, U.crc_of = saved  # type: ignore


def crc32c_throughput(gib: float = 0.25, runs: int = 5, hot: bool = False) -> dict[str, float]:
    """CRC32C alone on one core, GiB/s over a ``gib`` buffer (cold: read from memory, as in a save): min /
    median / max of ``runs``. ``hot``: a 4 MiB buffer checksummed over and over (in cache), the ceiling a
    CRC fused with another pass over the same bytes could reach."""
    from spotguard.storage.integrity import crc32c

    buf = bytearray(os.urandom(1 << 20)) * (4 if hot else int(gib * 1024))
    reps = int(gib * GiB) // len(buf) if hot else 1
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            crc32c(buf)
        rates.append(len(buf) * reps / GiB / (time.perf_counter() - t0))
    return _spread(rates)


def memory_read_throughput(gib: float = 0.25, runs: int = 5) -> dict[str, float]:
    """The floor under any checksum of bytes read from memory: one core reading a ``gib`` buffer with
    SIMD and doing nothing else (numpy's max over 64-bit words), GiB/s min / median / max of ``runs``."""
    import numpy as np

    words = np.frombuffer(bytearray(os.urandom(1 << 20)) * int(gib * 1024), dtype=np.uint64)
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        words.max()
        rates.append(words.nbytes / GiB / (time.perf_counter() - t0))
    return _spread(rates)


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=2)
    state = _state(int(a.size * GiB))
    tensors = [t for d in state.values() for t in d.values()]
    nbytes = sum(t.nbytes for t in tensors)
    bucket = "bench"
    if a.method == "spotguard":
        from spotguard.storage.objstore import DEFAULT_CONCURRENCY, env_int

        conns = env_int("SPOTGUARD_UPLOAD_CONCURRENCY", DEFAULT_CONCURRENCY)
        # Interleaved rounds in the same processes, so the references and the uploader see the same
        # machine: a warm-up round, then `rounds` rounds in rotating order. One storage per
        # configuration (the hook keeps one per job), each save the next step: "spotguard" with
        # `conns` connections per rank (the default), "spotguard1" with one.
        from spotguard.storage import open_storage
        from spotguard.storage.s3 import S3Storage

        storages = {"spotguard": open_storage(f"s3://{bucket}/{a.method}-{a.size}-{a.run_id}"),
                    "spotguard1": S3Storage(f"s3://{bucket}/{a.method}1-{a.size}-{a.run_id}", concurrency=1),
                    "spotguard_nocrc": open_storage(f"s3://{bucket}/{a.method}n-{a.size}-{a.run_id}")}
        kinds = ALL_KINDS if os.environ.get("SPOTGUARD_BENCH_CHECKSUM_ONLY") != "1" else \
            ["spotguard", "spotguard_nocrc"]  # only what the checksum cost needs: more rounds in the same time
        rounds: list[dict[str, float]] = []
        extra = 0
        for r in range(a.rounds + 1):
            row: dict[str, float] = {}
            for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                gc.collect()  # not inside a timed section: a collection there is noise, not the method
                cpu0 = cpu_seconds()
                if k.startswith("spotguard"):
                    with _no_checksums() if k == "spotguard_nocrc" else contextlib.nullcontext():
                        row[k], mem, row[f"busy_{k}"] = spotguard_round(state, a.rank, storages[k], r + 1)
                    if r and k == "spotguard":
                        extra = max(extra, mem)
                else:
                    row[k] = raw_round(a.ack_port, tensors, a.rank, 1 if k == "raw1" else conns)
                row[f"cpu_{k}"] = cpu_seconds() - cpu0  # this rank's CPU (all threads), barriers included
            if r:  # round 0 warms every path up
                rounds.append(row)
        out = {"rank": a.rank, "state_bytes": nbytes, "rounds": rounds, "connections": conns,
               "timed": {"seconds": _median([x["spotguard"] for x in rounds]), "extra_rss": extra}}
        Path(a.out).write_text(json.dumps(out))
        dist.destroy_process_group()
        return
    results = []
    import boto3

    client = boto3.client("s3", config=_boto_config())  # built before any clock starts, like spotguard's
    for it in range(2):  # warm-up, then timed
        tag = f"{a.method}-{a.size}-{a.run_id}-{it}"  # fresh per run
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.monotonic()
            if a.method == "A":  # torch.save keeps its own CRC32 (its default)
                if a.rank == 0:
                    path = f"/tmp/sg-bench-{os.getpid()}.pt"
                    torch.save(state, path)
                    c = client
                    c.upload_file(path, bucket, f"{tag}/state.pt")
                    c.put_object(Bucket=bucket, Key=f"{tag}/COMMIT", Body=b"{}")
                    os.unlink(path)
            else:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                w = FsspecWriter(f"s3://{bucket}/{tag}/step", sync_files=False,
                                 endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                                 config_kwargs={"s3": {"payload_signing_enabled": _sign()}})
                dcp.save(state, storage_writer=w)
                dist.barrier()
                if a.rank == 0:
                    client.put_object(Bucket=bucket, Key=f"{tag}/COMMIT", Body=b"{}")
            dist.barrier()
            t1 = time.monotonic()
        results.append({"seconds": t1 - t0, "extra_rss": mem.extra})
    out = {"rank": a.rank, "state_bytes": nbytes, "warmup": results[0], "timed": results[1]}
    Path(a.out).write_text(json.dumps(out))
    dist.destroy_process_group()


# --- driver -------------------------------------------------------------------------


def _spread(xs: list[float], digits: int = 2) -> dict[str, float]:
    """min / median / max of ``xs``, rounded: how every repeated figure here is reported."""
    return {"min": round(min(xs), digits), "median": round(_median(xs), digits), "max": round(max(xs), digits)}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def run_method(method: str, size: float, env: dict[str, str], tmp: Path, reps: int, ack_port: int,
               rounds: int) -> dict[str, Any]:
    runs = [run_one(method, size, env, tmp, ack_port, rounds) for _ in range(1 if method == "spotguard" else reps)]
    if len(runs) == 1:
        return runs[0]
    secs = [r["notice_to_commit_s"] for r in runs]
    best = min(runs, key=lambda r: abs(r["notice_to_commit_s"] - _median(secs)))
    return {**best, "notice_to_commit_s": round(_median(secs), 3),
            "throughput_gib_s": round(runs[0]["state_bytes"] / _median(secs) / GiB, 3),
            "runs_s": secs, "min_s": min(secs), "max_s": max(secs)}


def run_one(method: str, size: float, env: dict[str, str], tmp: Path, ack_port: int, rounds: int) -> dict[str, Any]:
    port = free_port()
    run_id = uuid.uuid4().hex[:8]  # fresh prefixes: a committed checkpoint is never overwritten
    procs = []
    for r in range(2):
        cmd = [sys.executable, "-m", "benchmarks.bench_storage", "--rank", str(r), "--method", method,
               "--size", str(size), "--port", str(port), "--run-id", run_id, "--ack-port", str(ack_port),
               "--rounds", str(rounds), "--out", str(tmp / f"{method}-{size}-{r}.json")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{method} {size} GiB failed:\n" + "\n".join(o[-3000:] for o in outs))
    ranks = [json.loads((tmp / f"{method}-{size}-{r}.json").read_text()) for r in range(2)]
    secs = ranks[0]["timed"]["seconds"]
    state = ranks[0]["state_bytes"]
    out: dict[str, Any] = {
        "notice_to_commit_s": round(secs, 3),
        "throughput_gib_s": round(state / secs / GiB, 3),
        "peak_extra_rss_mib_per_rank": [round(r["timed"]["extra_rss"] / 2**20, 1) for r in ranks],
        "peak_extra_rss_x_state": round(max(r["timed"]["extra_rss"] for r in ranks) / state, 4),
        "state_bytes": state,
    }
    if "warmup" in ranks[0]:
        out["warmup_s"] = round(ranks[0]["warmup"]["seconds"], 3)
    if "rounds" in ranks[0]:
        rows = ranks[0]["rounds"]
        out["runs_s"] = [round(x["spotguard"], 3) for x in rows]
        out["min_s"], out["max_s"] = min(out["runs_s"]), max(out["runs_s"])
        out["runs_nocrc_s"] = [round(x["spotguard_nocrc"], 3) for x in rows]
        # what spotguard's checksums cost, per round (interleaved): (with - without) / with
        shares = [(x["spotguard"] - x["spotguard_nocrc"]) / x["spotguard"] for x in rows]
        out["checksum_share_of_notice_to_commit"] = round(_median(shares), 3)
        out["checksum_share_range"] = [round(min(shares), 3), round(max(shares), 3)]
        out["connections_per_rank"] = ranks[0]["connections"]
        ran = [k for k in ALL_KINDS if k in rows[0]]
        for k in ran:  # rank 0's CPU s per GiB sent
            out[f"cpu_s_per_gib_{k}"] = round(_median([x[f"cpu_{k}"] for x in rows]) / (state / 2 / GiB), 3)
        cpu_extra = [(x["cpu_spotguard"] - x["cpu_spotguard_nocrc"]) / (state / 2 / GiB) for x in rows]
        out["checksum_cpu_s_per_gib"] = round(_median(cpu_extra), 3)
        out["checksum_cpu_s_per_gib_range"] = [round(min(cpu_extra), 3), round(max(cpu_extra), 3)]
        out["checksum_shares"] = [round(x, 3) for x in shares]
        for k in ("spotguard", "spotguard_nocrc"):  # the machine's CPU busy over rank 0's timed section
            busy = [x[f"busy_{k}"] for x in rows]
            out[f"machine_cpu_busy_{k}"] = _spread(busy, 3)
        for k in ("raw1", "rawN", "spotguard1"):
            if k in ran:
                out[f"{k}_gib_s"] = round(state / _median([x[k] for x in rows]) / GiB, 3)
        # per round, measured back to back: uploader throughput / the reference's
        for name, num, den in (("efficiency_vs_raw1", "raw1", "spotguard"),  # one raw stream per rank
                               ("efficiency_vs_rawN", "rawN", "spotguard"),  # as many streams as the uploader
                               ("efficiency_1conn_vs_raw1", "raw1", "spotguard1")):  # both one per rank
            if num not in ran or den not in ran:
                continue
            ratios = [x[num] / x[den] for x in rows]
            out[name] = round(_median(ratios), 3)
            out[f"{name}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return out


def run(sizes: list[float] | None = None) -> dict[str, Any]:
    import tempfile

    if sizes is None:
        sizes = [float(s) for s in os.environ.get("SPOTGUARD_BENCH_SIZES", "1").split(",") if s.strip()]
    reps = max(1, int(os.environ.get("SPOTGUARD_BENCH_REPS", "5") or 5))
    rounds = max(1, int(os.environ.get("SPOTGUARD_BENCH_ROUNDS", "7") or 7))
    methods = [m.strip() for m in os.environ.get("SPOTGUARD_BENCH_METHODS", "spotguard,A,B").split(",") if m.strip()]
    if not methods or set(methods) - {"spotguard", "A", "B"}:
        raise SystemExit("$SPOTGUARD_BENCH_METHODS: a comma-separated subset of spotguard,A,B")
    port, ack_port = free_port(), free_port()
    link = float(os.environ.get("SPOTGUARD_BENCH_LINK_GBIT", "0") or 0)
    sink = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port),
                             "--ack-port", str(ack_port), "--gbit", str(link)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                   AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                   AWS_REQUEST_CHECKSUM_CALCULATION="when_required",  # same for every method
                   AWS_RESPONSE_CHECKSUM_VALIDATION="when_required",
                   SPOTGUARD_S3_SIGN_PAYLOAD="1" if _sign() else "0",  # same for every method
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_DEFAULT_REGION")})
        import boto3
        from botocore.config import Config

        boto3.client("s3", config=Config(s3={"addressing_style": "path"})).create_bucket(Bucket="bench")
        out: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                               "methods": methods,
                               "payload_signing": "on (every method)" if _sign() else "off (every method)",
                               "reps": reps, "rounds": rounds, "sizes": {},
                               "link_gbit": link or "none (loopback: CPU-bound)",
                               "crc32c_gib_s_one_core": crc32c_throughput(),
                               "crc32c_gib_s_one_core_in_cache": crc32c_throughput(hot=True),
                               "memory_read_gib_s_one_core": memory_read_throughput()}
        with tempfile.TemporaryDirectory() as td:
            for size in sizes:
                row: dict[str, Any] = {}
                for method in methods:
                    try:
                        row[method] = run_method(method, size, env, Path(td), reps, ack_port, rounds)
                    except Exception as exc:  # noqa: BLE001 - report, keep the other figures
                        row[method] = {"error": str(exc)[-600:]}
                    print(f"{size} GiB {method}: {row[method]}", flush=True)
                sg = row.get("spotguard", {}).get("notice_to_commit_s")
                for base in ("A", "B"):
                    b = row.get(base, {}).get("notice_to_commit_s")
                    if sg and b:
                        row[f"speedup_vs_{base}"] = round(b / sg, 2)
                if sg and "efficiency_vs_raw1" in row["spotguard"]:
                    eff = row["spotguard"]["efficiency_vs_raw1"]
                    # GB per node that fit in 25 s at a NIC of G Gbit/s, at the (end-to-end) efficiency
                    # against one raw stream per rank
                    row["projection_gb_in_25s"] = {f"{g}Gbit": round(min(eff, 1.0) * g / 8 * 25, 1)
                                                   for g in (10, 25, 100)}
                out["sizes"][f"{size:g}GiB"] = row
        out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        return out
    finally:
        sink.terminate()
        try:
            sink.wait(15)
        except subprocess.TimeoutExpired:  # a loaded box: do not fail the figures over the sink's exit
            sink.kill()
            sink.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--method")
    ap.add_argument("--size", type=float)
    ap.add_argument("--port", type=int)
    ap.add_argument("--ack-port", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--run-id", default="0")
    ap.add_argument("--out")
    ap.add_argument("--sizes", default=None)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a)
        return
    sizes = [float(s) for s in a.sizes.split(",")] if a.sizes else None
    result = run(sizes)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
