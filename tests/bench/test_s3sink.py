"""The benchmark sink (``benchmarks/s3sink.py``) and the storage benchmark, against real processes.

The sink is the instrument behind the upload figures, so it is tested like
product code: boto3 and spotguard speak to it over loopback, small objects come
back byte for byte while large uploads drain through the one shared scratch
buffer, and the acknowledged raw stream answers only after the last byte.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sink() -> Iterator[dict[str, int]]:
    port, ack = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port), "--ack-port", str(ack)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the S3 port listens (the ack port listens before it)
        assert "s3sink listening" in line, line
        yield {"port": port, "ack": ack}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def s3(sink: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> Any:
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config

    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{sink['port']}", "AWS_ACCESS_KEY_ID": "t",
                 "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                 "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))
    client.create_bucket(Bucket="b")
    return client


def test_small_objects_come_back_intact_while_large_uploads_share_the_scratch_buffer(s3: Any) -> None:
    rng = random.Random(7)
    small = {f"small-{i}": rng.randbytes(rng.randrange(1, 900 * 1024)) for i in range(12)}
    big = bytes(range(256)) * (24 * MiB // 256)
    errors: list[BaseException] = []

    def upload_big(i: int) -> None:
        try:
            s3.put_object(Bucket="b", Key=f"big-{i}", Body=big)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def put_small(key: str, data: bytes) -> None:
        try:
            s3.put_object(Bucket="b", Key=key, Body=data)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=upload_big, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=put_small, args=kv) for kv in small.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for key, data in small.items():
        assert s3.get_object(Bucket="b", Key=key)["Body"].read() == data, key
    # large bodies are counted, not kept
    assert s3.head_object(Bucket="b", Key="big-0")["ContentLength"] == len(big)


def test_multipart_upload_through_spotguard_commits(s3: Any) -> None:
    from spotguard.storage.commit import CommitRecord, commit, newest_committed, prepare_attempt
    from spotguard.storage.s3 import S3Storage

    store = S3Storage("s3://b/run", part_size=5 * MiB, concurrency=4)
    key = prepare_attempt(store, 3)
    with store.open_upload(f"{key}/shard") as up:
        up.write(b"x" * (17 * MiB + 5))  # 4 parts
    commit(store, 3, CommitRecord(step=3))
    best = newest_committed(store)
    assert best is not None and best.step == 3 and best.record is not None
    assert best.record.files == {"shard": 17 * MiB + 5}
    assert store.incomplete_uploads() == []


def test_acked_stream_is_acknowledged_only_after_every_byte(sink: dict[str, int]) -> None:
    n = 3 * MiB + 11
    with socket.create_connection(("127.0.0.1", sink["ack"])) as s:
        s.sendall(n.to_bytes(8, "big"))
        s.sendall(b"a" * (n - 1))
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):  # one byte short: no acknowledgement yet
            s.recv(1)
        s.settimeout(10)
        s.sendall(b"z")
        assert s.recv(1) == b"k"


def _start_sink(*extra: str) -> tuple["subprocess.Popen[str]", int, int]:
    port, ack = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port), "--ack-port", str(ack),
                             *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "s3sink listening" in line, line
    return proc, port, ack


def _acked_seconds(ack: int, n: int, lanes: int) -> float:
    """Seconds until ``lanes`` parallel acked streams of ``n`` bytes each are all acknowledged."""
    import time

    done: list[float] = []

    def lane() -> None:
        with socket.create_connection(("127.0.0.1", ack)) as s:
            s.sendall(n.to_bytes(8, "big"))
            s.sendall(b"q" * n)
            assert s.recv(1) == b"k"
            done.append(time.monotonic())

    t0 = time.monotonic()
    threads = [threading.Thread(target=lane) for _ in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == lanes
    return max(done) - t0


def test_link_option_caps_what_all_connections_receive_together() -> None:
    """``--gbit`` is one node's link: 3 streams of 4 MiB through 0.2 Gbit/s (25 MB/s) need ~0.5 s together;
    without it loopback takes milliseconds. Both directions of the bound are checked."""
    n, lanes, gbit = 4 * MiB, 3, 0.2
    floor = n * lanes / (gbit * 1e9 / 8)
    proc, _port, ack = _start_sink("--gbit", str(gbit))
    try:
        paced = _acked_seconds(ack, n, lanes)
    finally:
        proc.terminate()
        proc.wait(10)
    assert floor * 0.95 <= paced < floor * 4 + 2, (paced, floor)
    proc, _port, ack = _start_sink()
    try:
        free = _acked_seconds(ack, n, lanes)
    finally:
        proc.terminate()
        proc.wait(10)
    assert free < floor / 2, (free, floor)


def test_link_option_refuses_a_negative_rate() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.s3sink", "--port", str(_free_port()), "--gbit", "-1"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--gbit" in out.stderr, out.stderr


@pytest.mark.timeout(600)
def test_storage_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    """The smallest real run of ``bench_storage`` (2 gloo ranks, 64 MiB): every method and figure present."""
    pytest.importorskip("torch")
    pytest.importorskip("s3fs")
    env = dict(os.environ, SPOTGUARD_BENCH_ROUNDS="1", SPOTGUARD_BENCH_REPS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_storage", "--sizes", "0.0625"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{\n"):])
    row = result["sizes"]["0.0625GiB"]
    for method in ("spotguard", "A", "B"):
        assert "error" not in row[method], row[method]
        assert row[method]["notice_to_commit_s"] > 0
    sg = row["spotguard"]
    assert sg["state_bytes"] == 64 * MiB
    for key in ("efficiency_vs_raw1", "efficiency_vs_rawN", "efficiency_1conn_vs_raw1"):
        assert 0 < sg[key] < 10, (key, sg[key])
    for key in ("machine_cpu_busy_spotguard", "machine_cpu_busy_spotguard_nocrc"):  # is there CPU to hide in?
        assert 0 < sg[key]["median"] <= 1, (key, sg[key])
    assert 0 < result["memory_read_gib_s_one_core"]["median"] < 1000  # the floor under any checksum
    for key in ("raw1_gib_s", "rawN_gib_s", "cpu_s_per_gib_spotguard"):
        assert sg[key] > 0, key
    assert row["speedup_vs_A"] > 0 and row["speedup_vs_B"] > 0
    assert set(row["projection_gb_in_25s"]) == {"10Gbit", "25Gbit", "100Gbit"}
    # integrity is inside the timed path, and what it costs is measured against a no-checksum reference
    assert -1 < sg["checksum_share_of_notice_to_commit"] < 1 and len(sg["runs_nocrc_s"]) == len(sg["runs_s"])
    assert result["crc32c_gib_s_one_core"]["median"] > 0
    assert "min_s" not in row["A"] or row["A"]["min_s"] <= row["A"]["notice_to_commit_s"] <= row["A"]["max_s"]
