"""zero-copy uploads produce byte-identical files to FileSystemWriter and load with FileSystemReader."""
import os
import pytest, torch
import torch.utils.serialization
import torch.distributed.checkpoint as dcp
from .test_objstore import MemStore
from spotguard.storage.objstore import Segments
from spotguard.storage.commit import CommitRecord, commit
from spotguard.storage.safeload import SafeLoadPlanner


class ZCStore(MemStore):
    zero_copy = True
    seen_segments = 0

    def _put(self, name, data, crc=None):
        if isinstance(data, Segments):
            type(self).seen_segments += 1
        super()._put(name, memoryview(bytes(data)))


def _state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3_000_000, generator=g)
    return {
        "a": torch.randn(700, 900, generator=g),                  # 2.4 MB contiguous
        "t": torch.randn(800, 600, generator=g).t(),              # non-contiguous: cloned
        "v": big[100:1_200_000],                                  # view of a bigger storage: cloned
        "bf": torch.randn(1_500_000, generator=g).bfloat16(),     # numpy has no bf16
        "small": torch.arange(10.0),
        "scalar": torch.tensor(3.5),
        "i8": torch.randint(-5, 5, (2_000_001,), dtype=torch.int8, generator=g),
        "meta": {"x": 1, "s": "y"},
    }


@pytest.mark.parametrize("part,zpart", [(65536, 65536), (300_000, 1_000_000), (64 << 20, 64 << 20)])
def test_identical_to_filesystem_writer(tmp_path, monkeypatch, part, zpart):
    monkeypatch.setenv("SPOTGUARD_ZERO_COPY_PART_SIZE", str(zpart))
    sd = _state()
    cfg = torch.utils.serialization.config.save
    prev = cfg.compute_crc32
    cfg.compute_crc32 = False
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs"), single_file_per_rank=True, sync_files=False), no_dist=True)
    finally:
        cfg.compute_crc32 = prev
    s = ZCStore(part_size=part, concurrency=3)
    s.min_part_size = 16
    dcp.save(sd, storage_writer=s.dcp_writer("step-00000001"), no_dist=True)
    rec = commit(s, 1, CommitRecord(step=1))
    fs_files = sorted(f for f in os.listdir(tmp_path / "fs") if f.endswith(".distcp"))
    for f in fs_files:
        a = (tmp_path / "fs" / f).read_bytes()
        b = s.objects["root/step-00000001/" + f]
        assert len(a) == len(b), f
        diff = [i for i in range(0, len(a), 1) if a[i] != b[i]] if a != b else []
        assert not diff, (f, len(diff), diff[:20], a[diff[0]-40:diff[0]+40])
    dest = s.download("step-00000001", tmp_path / "dl")
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {}) for k, v in sd.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(dest), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
    out2 = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {}) for k, v in sd.items()}
    dcp.load(out2, storage_reader=s.dcp_reader("step-00000001", rec.checksums), planner=SafeLoadPlanner(),
             no_dist=True)
    assert all(torch.equal(out2[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))
    assert s.pool().allocated_bytes <= s.pool().count * part
    assert not s.open_uploads


def test_temporaries_are_kept_alive_until_sent(monkeypatch):
    """A clone made for the upload (view of a bigger storage) is freed by the producer at once;
    the part must keep it alive: overwrite freed memory aggressively and check the bytes."""
    import threading, time
    s = ZCStore(part_size=1 << 20, concurrency=2)
    s.min_part_size = 16
    gate = threading.Event()
    orig = type(s).__mro__[1]._start_upload

    class Slow(ZCStore):
        pass
    sd = {f"v{i}": torch.full((4_000_000,), float(i))[1:] for i in range(6)}  # views: cloned, temporaries
    real_part = None
    from storage.test_objstore import _MemUpload
    def part(self, number, data, last):
        time.sleep(0.05)
        junk = [torch.full((4_000_000,), -1.0) for _ in range(3)]  # reuse freed memory
        del junk
        return bytes(data)
    monkeypatch.setattr(_MemUpload, "part", part)
    dcp.save(sd, storage_writer=s.dcp_writer("ck"), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=s.dcp_reader("ck"), no_dist=True)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k


def test_zero_copy_path_is_taken(monkeypatch):
    from storage.test_objstore import _MemUpload
    kinds = []
    orig = _MemUpload.part
    def part(self, number, data, last):
        kinds.append(type(data).__name__)
        return orig(self, number, data, last)
    monkeypatch.setattr(_MemUpload, "part", part)
    s = ZCStore(part_size=1 << 20, concurrency=2)
    sd = {"w": torch.randn(3_000_000)}
    dcp.save(sd, storage_writer=s.dcp_writer("ck"), no_dist=True)
    assert "Segments" in kinds, kinds
    monkeypatch.setenv("SPOTGUARD_ZERO_COPY", "0")
    kinds.clear()
    s = ZCStore(part_size=1 << 20, concurrency=2)
    dcp.save(sd, storage_writer=s.dcp_writer("ck2"), no_dist=True)
    assert kinds and "Segments" not in kinds, kinds
    print(sorted(s.objects))
