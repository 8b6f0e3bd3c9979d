"""Device→host staging pool (spotguard/storage/staging.py) on CPU tensors.

No CUDA here: these run the pool, the chunk plan, the in-order / back-pressure
logic and the placeholder swap inside the object-store writer with ordinary
host buffers and synchronous copies. The pinned buffers, copy stream and events
only run under ``make gpu-check``.
"""
import json
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.utils.serialization

from spotguard.storage import staging
from spotguard.storage.commit import CommitRecord, commit
from spotguard.storage.staging import HostPool, Stager, chunk_spans, copy_to_host
from .test_objstore import MemStore
from .test_zero_copy import ZCStore, _state


def test_chunk_spans_cover_range_in_order():
    assert chunk_spans(0, 10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(3, 3, 4) == []
    assert chunk_spans(5, 13, 8) == [(5, 8)]
    with pytest.raises(ValueError):
        chunk_spans(0, 1, 0)


def test_chunks_reassemble_bytes_and_respect_pool_bound():
    t = torch.randn(1_000_003)  # 4 MB, not a multiple of the chunk
    stager = Stager(HostPool(3, 65536, pin=False))
    got = bytearray()
    for view in stager.chunks(t):
        assert stager.pool.peak_in_use <= 3
        got += view
    assert bytes(got) == t.numpy().tobytes()
    assert stager.pool.peak_in_use == 3  # the copies really overlap: all buffers were in flight
    assert stager.pool.allocated_bytes == 3 * 65536
    sub = b"".join(bytes(v) for v in stager.chunks(t, 1000, 300_000))
    assert sub == t.numpy().tobytes()[1000:300_000]


def test_abandoned_stream_returns_its_buffers():
    stager = Stager(HostPool(2, 4096, pin=False))
    gen = stager.chunks(torch.zeros(100_000))
    next(gen)
    gen.close()
    assert stager.pool._in_use == 0
    assert stager.pool.try_acquire(block=False) is not None


def test_producers_sharing_a_small_pool_do_not_deadlock():
    stager = Stager(HostPool(2, 4096, pin=False))
    tensors = [torch.randn(50_000 + i) for i in range(4)]
    out: dict[int, bytes] = {}

    def run(i):
        out[i] = b"".join(bytes(v) for v in stager.chunks(tensors[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "producers deadlocked on the shared pool"
    assert all(out[i] == tensors[i].numpy().tobytes() for i in range(4))
    assert stager.pool.peak_in_use <= 2


def test_copy_to_host_is_bitwise_and_keeps_layout():
    g = torch.Generator().manual_seed(1)
    stager = Stager(HostPool(2, 1 << 16, pin=False))
    for t in (torch.randn(300, 700, generator=g), torch.randn(600, 500, generator=g).t(),
              torch.randn(400_000, generator=g).bfloat16(), torch.randn(1000, generator=g)[10:900]):
        c = copy_to_host(t, stager)
        assert c.dtype == t.dtype and c.shape == t.shape and c.stride() == t.stride()
        assert torch.equal(c.view(torch.uint8) if c.dtype == torch.bfloat16 else c,
                           t.view(torch.uint8) if t.dtype == torch.bfloat16 else t)
        assert c.data_ptr() != t.data_ptr()
    assert stager.bytes_staged > 0


def test_bad_pool_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_STAGING_BUFFERS", "lots")
    with pytest.raises(ValueError, match="SPOTGUARD_STAGING_BUFFERS"):
        staging.shared_stager()
    monkeypatch.setenv("SPOTGUARD_STAGING_BUFFERS", "0")
    with pytest.raises(ValueError, match=">= 1"):
        staging.shared_stager()


def test_mode_selects_tensors(monkeypatch):
    big, small = torch.zeros(1 << 19), torch.zeros(10)
    monkeypatch.delenv("SPOTGUARD_STAGING", raising=False)
    assert not staging.wants_staging(big)  # CPU tensors keep the zero-copy path by default
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    assert staging.wants_staging(big) and not staging.wants_staging(small)
    monkeypatch.setenv("SPOTGUARD_STAGING", "off")
    assert not staging.wants_staging(big)


@pytest.mark.parametrize("store_cls", [MemStore, ZCStore])
def test_writer_through_pool_is_identical_to_filesystem_writer(tmp_path, monkeypatch, store_cls):
    """SPOTGUARD_STAGING=all sends CPU tensors down the device path (placeholder + pool): the files
    must be byte-identical to the stock writer's and every large tensor byte must come from the pool."""
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    monkeypatch.setenv("SPOTGUARD_STAGING_BUFFERS", "2")
    monkeypatch.setenv("SPOTGUARD_STAGING_CHUNK_MB", "1")
    sd = _state()
    cfg = torch.utils.serialization.config.save
    prev = cfg.compute_crc32
    cfg.compute_crc32 = False
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs"), single_file_per_rank=True,
                                                         sync_files=False), no_dist=True)
    finally:
        cfg.compute_crc32 = prev
    stager = staging.shared_stager()
    before = stager.bytes_staged
    s = store_cls(part_size=300_000, concurrency=3)
    s.min_part_size = 16
    dcp.save(sd, storage_writer=s.dcp_writer("step-00000001"), no_dist=True)
    commit(s, 1, CommitRecord(step=1))
    staged_expected = sum(v.nbytes for v in sd.values()
                          if isinstance(v, torch.Tensor) and v.nbytes >= staging.STAGE_MIN_BYTES)
    assert stager.bytes_staged - before == staged_expected
    assert stager.pool.peak_in_use <= 2 and stager.pool.allocated_bytes <= 2 << 20
    for f in sorted(f for f in os.listdir(tmp_path / "fs") if f.endswith(".distcp")):
        assert (tmp_path / "fs" / f).read_bytes() == bytes(s.objects["root/step-00000001/" + f]), f
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {}) for k, v in sd.items()}
    dcp.load(out, storage_reader=s.dcp_reader("step-00000001"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def test_crc_setting_keeps_the_plain_path(monkeypatch):
    """torch.save would checksum the unfilled placeholder: with SPOTGUARD_CRC32=1 nothing is staged."""
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    monkeypatch.setenv("SPOTGUARD_CRC32", "1")
    stager = staging.shared_stager()
    before = stager.bytes_staged
    s = MemStore(part_size=300_000, concurrency=2)
    s.min_part_size = 16
    sd = {"a": torch.randn(700, 900)}
    dcp.save(sd, storage_writer=s.dcp_writer("step-00000001"), no_dist=True)
    assert stager.bytes_staged == before
    out = {"a": torch.zeros(700, 900)}
    dcp.load(out, storage_reader=s.dcp_reader("step-00000001"), no_dist=True)
    assert torch.equal(out["a"], sd["a"])


def test_views_stage_their_range_and_strided_views_take_the_plain_path(monkeypatch):
    """A contiguous view stages its own byte range of the storage (no clone); a strided view of a
    bigger storage is not staged (a device clone could OOM a full GPU) and still saves right."""
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    big = torch.randn(3_000_000, generator=torch.Generator().manual_seed(3))
    sd = {"view": big[123_457:1_500_000], "strided": big[1:2_000_001:2]}
    stager = staging.shared_stager()
    before = stager.bytes_staged
    s = MemStore(part_size=300_000, concurrency=2)
    s.min_part_size = 16
    dcp.save(sd, storage_writer=s.dcp_writer("step-00000001"), no_dist=True)
    assert stager.bytes_staged - before == sd["view"].nbytes
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=s.dcp_reader("step-00000001"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


_RSS_SCRIPT = r"""
import json, os, resource, sys, torch
import torch.distributed.checkpoint as dcp
from spotguard.storage import open_storage
t = torch.randn(128 << 20)  # 512 MiB, filled (resident) before the baseline is read
store = open_storage("s3://bench/rss")
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
dcp.save({"w": t}, storage_writer=store.dcp_writer("step-00000001"), no_dist=True)
from spotguard.storage import staging
print(json.dumps({"growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0,
                  "staged": staging.shared_stager().bytes_staged}))
"""


def test_placeholder_is_never_resident(tmp_path):
    """The CPU placeholder torch.save writes from is never touched: saving 512 MiB through the pool
    to the S3 sink grows peak RSS by the pool and part buffers only, not by another 512 MiB."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.s3sink import spawn

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = spawn(port, str(repo))
    try:
        env = {**os.environ, "PYTHONPATH": str(repo), "SPOTGUARD_STAGING": "all",
               "SPOTGUARD_STAGING_BUFFERS": "2", "SPOTGUARD_STAGING_CHUNK_MB": "4",
               "SPOTGUARD_UPLOAD_CONCURRENCY": "2", "SPOTGUARD_PART_SIZE": "8MiB",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "b",
               "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-east-1", "SPOTGUARD_S3_SIGN_PAYLOAD": "0",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        sink.kill()
        sink.wait()
    assert res["staged"] == 512 << 20
    assert res["growth"] < 200 << 20, res  # pool 8 MiB + parts + client; a touched placeholder adds 512


def test_producer_threads_skip_the_crc_too(tmp_path, monkeypatch):
    """torch's CRC32 setting is thread-local: with two files per rank the second producer thread
    must skip it as well (it would checksum a never-filled placeholder), so both files equal the
    stock writer's without CRC32."""
    from unittest import mock

    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    sd = _state()
    with mock.patch("torch.serialization.get_crc32_options", return_value=False):  # every thread
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs"), single_file_per_rank=True,
                                                         sync_files=False, thread_count=2), no_dist=True)
    s = MemStore(part_size=300_000, concurrency=3)
    s.min_part_size = 16
    dcp.save(sd, storage_writer=s.dcp_writer("step-00000001", thread_count=2), no_dist=True)
    commit(s, 1, CommitRecord(step=1))
    files = sorted(f for f in os.listdir(tmp_path / "fs") if f.endswith(".distcp"))
    assert len(files) == 2
    for f in files:
        assert (tmp_path / "fs" / f).read_bytes() == bytes(s.objects["root/step-00000001/" + f]), f
