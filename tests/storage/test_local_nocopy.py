"""The local writer hands each file the tensor's own memory (issue 22: no per-tensor host copy).

The stock ``FileSystemWriter`` clones a view of a bigger storage and ``.cpu()``s a device tensor
before ``torch.save``: one host copy of the largest tensor while it is written. The local writer
must write the same bytes from the tensor's own memory (a view's alias, a staged placeholder).
"""
import os
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.utils.serialization

from spotguard.storage import local_dcp, staging
from spotguard.storage.commit import CommitRecord, commit
from spotguard.storage.local import LocalStorage
from spotguard.storage.safeload import SafeLoadPlanner
from .test_zero_copy import _state

MIN = 1 << 20  # writes this big are a tensor's storage, not pickle framing


def _stock(sd, path, crc=True, thread_count=1):
    # torch's config overrides are thread-local: patch the getter so every writer thread sees ``crc``
    with mock.patch("torch.serialization.get_crc32_options", return_value=crc):
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=False,
                                                         thread_count=thread_count), no_dist=True)


def _same_files(a, b):
    names = sorted(f for f in os.listdir(a) if f.endswith(".distcp"))
    assert names and names == sorted(f for f in os.listdir(b) if f.endswith(".distcp"))
    for f in names:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def _loads_both_ways(store, path, rec, sd):
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(out, storage_reader=store.dcp_reader("step-00000001", rec.checksums), planner=SafeLoadPlanner(),
             no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


def test_local_writer_writes_views_from_their_own_memory(tmp_path, monkeypatch):
    """A view of a bigger storage reaches the file as a write of the view's own bytes (the stock
    writer wrote a clone's); the files stay byte-identical to the stock writer's and load with the
    stock reader and ours."""
    monkeypatch.delenv("SPOTGUARD_STAGING", raising=False)
    writes = []
    orig = local_dcp._SummingStream.write

    def spy(self, b):
        mv = memoryview(b)
        if mv.nbytes >= MIN:
            import numpy as np

            writes.append((int(np.frombuffer(mv.cast("B"), dtype=np.uint8).__array_interface__["data"][0]),
                           mv.nbytes))
        return orig(self, b)

    monkeypatch.setattr(local_dcp._SummingStream, "write", spy)
    big = torch.randn(3_000_000, generator=torch.Generator().manual_seed(5))
    sd = {**_state(), "v2": big[1_000_000:2_500_000].view(1500, 1000)[:900], "bfv": big.bfloat16()[7:2_000_007]}
    store = LocalStorage(tmp_path / "ck")
    dcp.save(sd, storage_writer=store.dcp_writer("step-00000001"), no_dist=True)
    rec = commit(store, 1, CommitRecord(step=1))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.nbytes >= MIN and v.is_contiguous():
            assert (v.data_ptr(), v.nbytes) in writes, k  # not a copy's address
    _stock(sd, tmp_path / "fs")
    _same_files(tmp_path / "fs", tmp_path / "ck" / "step-00000001")
    _loads_both_ways(store, tmp_path / "ck" / "step-00000001", rec, sd)


def test_minimal_storage_aliases_dense_views_and_clones_the_rest():
    big = torch.randn(1_000_000)
    for v in (big[10:500_010], big[:600_000].view(600, 1000)[:300].t(), big.bfloat16()[3:1003]):
        m = staging.minimal_storage(v)
        assert m.data_ptr() == v.data_ptr() and m.untyped_storage().nbytes() == v.nbytes
        assert m.stride() == v.stride() and torch.equal(m, v)
    strided = big[1::2]
    m = staging.minimal_storage(strided)
    assert m.data_ptr() != strided.data_ptr() and torch.equal(m, strided)
    assert staging.minimal_storage(big) is not None and staging.minimal_storage(big).data_ptr() == big.data_ptr()


def test_local_writer_through_pool_is_identical_and_checksummed(tmp_path, monkeypatch):
    """SPOTGUARD_STAGING=all sends CPU tensors down the device path (placeholder + pool): the files
    must equal the stock writer's (without torch.save's CRC32, as on a GPU host), every large
    tensor byte comes from the pool, and the commit record's checksums are those of the file."""
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    monkeypatch.setenv("SPOTGUARD_STAGING_BUFFERS", "2")
    monkeypatch.setenv("SPOTGUARD_STAGING_CHUNK_MB", "1")
    sd = _state()
    stager = staging.shared_stager()
    before = stager.bytes_staged
    store = LocalStorage(tmp_path / "ck")
    dcp.save(sd, storage_writer=store.dcp_writer("step-00000001", thread_count=2), no_dist=True)
    rec = commit(store, 1, CommitRecord(step=1))
    staged = sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor) and v.nbytes >= staging.STAGE_MIN_BYTES)
    assert stager.bytes_staged - before == staged
    assert stager.pool.peak_in_use <= 2
    assert torch.utils.serialization.config.save.compute_crc32  # restored
    _stock(sd, tmp_path / "fs", crc=False, thread_count=2)
    _same_files(tmp_path / "fs", tmp_path / "ck" / "step-00000001")
    _loads_both_ways(store, tmp_path / "ck" / "step-00000001", rec, sd)


def test_unwritten_placeholder_fails_the_save(tmp_path, monkeypatch):
    """A torch that wrote a placeholder's storage some other way must fail the save, never leave
    placeholder bytes in a checkpoint."""
    monkeypatch.setenv("SPOTGUARD_STAGING", "all")
    monkeypatch.setattr(local_dcp._SummingFS, "staged_sources", lambda self: [])  # no swap happens
    store = LocalStorage(tmp_path / "ck")
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException is a BaseException
        dcp.save({"a": torch.randn(700, 900)}, storage_writer=store.dcp_writer("step-00000001"), no_dist=True)
    assert "staging a: torch.save wrote 0 of 2520000 storage bytes" in str(ei.value)
    assert store.write_log.peek("step-00000001") == {}  # nothing of it can reach a commit record
