"""Checkpoint integrity and trust: checksums from the writes, verification before use, data never code."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spotguard.hook.state import pack, unpack
from spotguard.storage import open_storage
from spotguard.storage.commit import (
    COMMIT_NAME,
    KEY_ENV,
    CommitRecord,
    commit,
    newest_committed,
    prepare_attempt,
    scan,
    step_dir,
)
from spotguard.storage.integrity import BLOCK_SIZE, Checksummer, DamagedCheckpoint, digest_of, verify_span
from spotguard.storage.listing import main as listing_main
from spotguard.storage.safeload import SafeLoadPlanner, load_dcp_metadata, safe_torch_load
from spotguard.storage.verify import download_checkpoint, safe_local_path, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


class Evil:
    """Unpickling this runs a command that creates ``marker``: a planted pickle."""

    marker = ""

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _evil(marker: Path) -> Evil:
    e = Evil()
    e.marker = str(marker)
    return e


def _save(store: Any, step: int, scale: float = 1.0) -> CommitRecord:
    prepare_attempt(store, step)
    sd = {"w": torch.arange(3 * BLOCK_SIZE // 4 + 1000, dtype=torch.float32) * scale, "meta": {"step": step}}
    dcp.save(sd, storage_writer=store.dcp_writer(step_dir(step)), no_dist=True)
    return commit(store, step, CommitRecord(step=step))


def _load(store: Any, step: int) -> dict[str, Any]:
    info = newest_committed(store, below=step + 1)
    assert info is not None and info.step == step and info.record is not None
    out = {"w": torch.zeros(3 * BLOCK_SIZE // 4 + 1000), "meta": {}}
    dcp.load(out, storage_reader=store.dcp_reader(info.dir, info.record.checksums), planner=SafeLoadPlanner(),
             no_dist=True)
    return out


def _flip(path: Path, at: int | None = None) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(b))


# --- checksums ------------------------------------------------------------------


def test_checksum_is_independent_of_chunking_and_catches_one_flipped_bit() -> None:
    data = os.urandom(2 * BLOCK_SIZE + 12345)
    c = Checksummer()
    for i in range(0, len(data), 777_777):
        c.update(memoryview(data)[i:i + 777_777])
    d = c.digest()
    assert d == digest_of(data) and d.size == len(data) and len(d.blocks) == 8 * 3
    verify_span("f", d, BLOCK_SIZE, data[BLOCK_SIZE:])  # a ranged read of the tail checks out
    bad = bytearray(data)
    bad[BLOCK_SIZE + 5] ^= 0x10
    with pytest.raises(DamagedCheckpoint, match=r"crc32c mismatch in bytes \[4194304, 8388608\)"):
        verify_span("f", d, 0, bytes(bad))


def test_record_lists_checksums_of_what_was_written(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    rec = _save(store, 1)
    assert set(rec.files) == {".metadata", "__0_0.distcp"} and rec.format == 2
    for name, d in rec.checksums.items():
        assert d == digest_of((tmp_path / step_dir(1) / name).read_bytes()), name
    on_disk = json.loads((tmp_path / step_dir(1) / COMMIT_NAME).read_text())
    assert on_disk["checksum"] == {"algorithm": "crc32c", "block_size": BLOCK_SIZE}
    assert set(on_disk["checksums"]) == set(on_disk["files"])


def test_record_comes_from_the_writes_not_from_a_listing(tmp_path: Path) -> None:
    """A file that appears in the folder without being written by the save is not vouched for."""
    store = open_storage(str(tmp_path))
    prepare_attempt(store, 2)
    store.write_bytes(f"{step_dir(2)}/a", b"written")
    (tmp_path / step_dir(2) / "planted").write_bytes(b"not written by any rank")
    rec = commit(store, 2, CommitRecord(step=2))
    assert set(rec.files) == {"a"}
    info = newest_committed(store)
    assert info is not None and info.committed and info.unlisted == ["planted"]


def test_commit_refuses_when_no_rank_reports_writing(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    prepare_attempt(store, 2)
    (tmp_path / step_dir(2)).mkdir(exist_ok=True)
    (tmp_path / step_dir(2) / "x").write_bytes(b"1")
    with pytest.raises(Exception, match="nothing to commit"):
        commit(store, 2, CommitRecord(step=2))


# --- verification on load ----------------------------------------------------------


def test_flipped_byte_is_refused_before_use_and_names_the_file(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    _save(store, 1)
    assert torch.equal(_load(store, 1)["w"][:10], torch.arange(10, dtype=torch.float32))
    shard = tmp_path / step_dir(1) / "__0_0.distcp"
    _flip(shard)
    assert newest_committed(store) is not None  # same size: only the checksum can tell
    with pytest.raises(BaseException) as info:
        _load(store, 1)
    assert "__0_0.distcp: crc32c mismatch" in str(info.value)
    with pytest.raises(DamagedCheckpoint, match="__0_0.distcp"):
        verify_checkpoint(store, newest_committed(store))


def _rchar() -> int:
    """Bytes this process has read through read(2)-like calls so far, page-cache hits included."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_local_load_reads_each_byte_once_and_still_verifies_every_block(tmp_path: Path) -> None:
    """One pass: the bytes DCP deserialises are the bytes whose checksums were checked (the old reader
    verified each file, then FileSystemReader read it again: ~2x the checkpoint)."""
    store = open_storage(str(tmp_path))
    n = 12 * BLOCK_SIZE // 4 + 123  # ~48 MiB of float32: several blocks and a partial one
    prepare_attempt(store, 1)
    sd = {"w": torch.arange(n, dtype=torch.float32), "v": torch.ones(1000), "meta": {"step": 1}}
    dcp.save(sd, storage_writer=store.dcp_writer(step_dir(1)), no_dist=True)
    commit(store, 1, CommitRecord(step=1))
    info = newest_committed(store)
    assert info is not None and info.record is not None
    total = sum(info.record.files.values())
    out = {"w": torch.zeros(n), "v": torch.zeros(1000), "meta": {"step": 0}}
    reader = store.dcp_reader(info.dir, info.record.checksums)
    before = _rchar()
    dcp.load(out, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    read = _rchar() - before
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["v"], sd["v"]) and out["meta"] == {"step": 1}
    assert total <= reader.bytes_read <= total + BLOCK_SIZE  # each file byte once (metadata: once per read_metadata)
    assert read < 1.3 * total, f"read {read / total:.2f}x the checkpoint's {total} bytes"
    # ... and a byte flipped anywhere in the shard still fails the load, naming the block
    _flip(tmp_path / step_dir(1) / "__0_0.distcp", at=9 * BLOCK_SIZE + 17)
    with pytest.raises(BaseException, match=r"__0_0.distcp: crc32c mismatch in bytes \[37748736, 41943040\)"):
        dcp.load({"w": torch.zeros(n), "v": torch.zeros(1000), "meta": {}},
                 storage_reader=store.dcp_reader(info.dir, info.record.checksums), planner=SafeLoadPlanner(),
                 no_dist=True)


def test_metadata_is_checked_against_the_record_before_it_is_unpickled(tmp_path: Path) -> None:
    """Both verifying readers share parse_metadata: unrecorded, resized or flipped .metadata is damage."""
    from spotguard.storage.dcp_items import parse_metadata

    store = open_storage(str(tmp_path))
    rec = _save(store, 1)
    raw = (tmp_path / step_dir(1) / ".metadata").read_bytes()
    where = f"{tmp_path}/{step_dir(1)}"
    md = parse_metadata(raw, rec.checksums, where, "load-1")
    assert md.storage_meta is not None and md.storage_meta.load_id == "load-1"
    unrecorded = {k: v for k, v in rec.checksums.items() if k != ".metadata"}
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata: not named in the commit record"):
        parse_metadata(raw, unrecorded, where, "x")
    with pytest.raises(DamagedCheckpoint, match="commit record says"):
        parse_metadata(raw[:-1], rec.checksums, where, "x")
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 1
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata: crc32c mismatch"):
        parse_metadata(bytes(flipped), rec.checksums, where, "x")
    # the local reader goes through it: a flipped .metadata fails the load before anything is unpickled
    _flip(tmp_path / step_dir(1) / ".metadata")
    with pytest.raises(BaseException, match=r"\.metadata: crc32c mismatch"):
        _load(store, 1)


def test_truncated_read_is_damage_not_a_short_tensor(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    rec = _save(store, 1)
    d = rec.checksums["__0_0.distcp"]
    from spotguard.storage.verify import read_verified

    shard = tmp_path / step_dir(1) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(DamagedCheckpoint, match="short read"):
        read_verified(store, f"{step_dir(1)}/__0_0.distcp", d, 0, d.size)


def test_download_only_names_from_the_record_and_checks_them(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "s"))
    _save(store, 1)
    (tmp_path / "s" / step_dir(1) / "planted.bin").write_bytes(b"x")
    dest = download_checkpoint(store, newest_committed(store), tmp_path / "dl")
    assert sorted(p.name for p in dest.iterdir()) == [".metadata", COMMIT_NAME, "__0_0.distcp"]
    _flip(tmp_path / "s" / step_dir(1) / "__0_0.distcp")
    with pytest.raises(DamagedCheckpoint):
        download_checkpoint(store, newest_committed(store), tmp_path / "dl2")
    assert not any(p.name == "__0_0.distcp" for p in (tmp_path / "dl2").rglob("*"))  # no half file kept


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "a\\..\\x", "a\x00b", "..", "a//b"])
def test_unsafe_names_never_become_paths(tmp_path: Path, name: str) -> None:
    with pytest.raises(DamagedCheckpoint):
        safe_local_path(tmp_path, name)


# --- data, never code ----------------------------------------------------------------


def test_planted_metadata_pickle_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(DamagedCheckpoint, match="forbidden global"):
        load_dcp_metadata(pickle.dumps(_evil(marker)), "x/.metadata")
    assert not marker.exists()


def test_real_metadata_passes_the_restricted_unpickler(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    _save(store, 1)
    md = load_dcp_metadata((tmp_path / step_dir(1) / ".metadata").read_bytes(), "m")
    assert "w" in md.state_dict_metadata


def test_planted_per_rank_pickle_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(DamagedCheckpoint, match="refused to load"):
        unpack(pack({"rng": _evil(marker)}))
    buf = io.BytesIO()
    torch.save(_evil(marker), buf)
    with pytest.raises(DamagedCheckpoint):
        safe_torch_load(buf.getvalue(), "item")
    assert not marker.exists()


def test_per_rank_state_with_numpy_rng_round_trips() -> None:
    import random

    import numpy as np

    per = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
           "loaders": {"l": {"perm": np.arange(4), "f": np.float64(1.5), "t": (1, "a"), "n": None}}}
    back = unpack(pack(per))
    assert back["rng"]["python"] == per["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], per["rng"]["numpy"][1])
    assert back["loaders"]["l"]["f"] == 1.5


def test_planted_metadata_with_a_forged_record_is_refused_on_load(tmp_path: Path) -> None:
    """An attacker who rewrites both .metadata and the record's checksum: the restricted loader stops it."""
    store = open_storage(str(tmp_path))
    _save(store, 1)
    marker = tmp_path / "pwned"
    folder = tmp_path / step_dir(1)
    evil = pickle.dumps(_evil(marker))
    (folder / ".metadata").write_bytes(evil)
    rec = json.loads((folder / COMMIT_NAME).read_text())
    rec["files"][".metadata"] = len(evil)
    rec["bytes"] = sum(rec["files"].values())
    rec["checksums"][".metadata"] = digest_of(evil).blocks
    (folder / COMMIT_NAME).write_text(json.dumps(rec))
    with pytest.raises(BaseException, match="forbidden global"):
        _load(store, 1)
    assert not marker.exists()


# --- HMAC -----------------------------------------------------------------------------


def test_signed_records_refuse_forgeries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "job-secret")
    store = open_storage(str(tmp_path))
    _save(store, 1)
    assert newest_committed(store) is not None
    path = tmp_path / step_dir(1) / COMMIT_NAME
    rec = json.loads(path.read_text())
    assert len(rec["hmac"]) == 64
    rec["notice_id"] = "forged"
    path.write_text(json.dumps(rec))
    info = scan(store)[0]
    assert not info.committed and "signature does not match" in (info.problem or "")
    del rec["hmac"]
    path.write_text(json.dumps(rec))
    assert "not signed" in (scan(store)[0].problem or "")
    monkeypatch.delenv(KEY_ENV)
    assert scan(store)[0].committed  # without the key, the record is only checked for content


# --- spotguard checkpoints --verify ----------------------------------------------------------


def test_checkpoints_verify_reports_which_are_good(tmp_path: Path) -> None:
    import argparse

    store = open_storage(str(tmp_path))
    _save(store, 1)
    _save(store, 2, scale=2.0)
    out, err = io.StringIO(), io.StringIO()
    assert listing_main(argparse.Namespace(uri=str(tmp_path), json=False, verify=True), out, err) == 0
    assert "verified 2 of 2" in out.getvalue()
    _flip(tmp_path / step_dir(2) / "__0_0.distcp")
    out = io.StringIO()
    assert listing_main(argparse.Namespace(uri=str(tmp_path), json=False, verify=True), out, err) == 1
    text = out.getvalue()
    assert "DAMAGED" in text and "__0_0.distcp" in text and "resume would load step-00000001" in text
    out = io.StringIO()
    assert listing_main(argparse.Namespace(uri=str(tmp_path), json=True, verify=True), out, err) == 1
    doc = json.loads(out.getvalue())
    assert [c["verified"] for c in doc["checkpoints"]] == [True, False]
    # the CLI entry point itself, exit code included
    r = subprocess.run([sys.executable, "-m", "spotguard", "checkpoints", "--verify", str(tmp_path)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 1 and "QUARANTINED" in r.stdout, r.stdout + r.stderr  # the first --verify set it aside


def test_damage_survives_dcp_exception_gathering() -> None:
    """DCP pickles each rank's exception to all ranks: the damage must arrive intact (seen with 2 ranks)."""
    from spotguard.storage.integrity import damage_in

    exc = pickle.loads(pickle.dumps(DamagedCheckpoint("s3://b/step-1/__0_0.distcp", "crc32c mismatch")))
    assert isinstance(exc, DamagedCheckpoint) and exc.what == "crc32c mismatch"
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("read", {1: (exc, [])})
    assert damage_in(wrapped) is exc and damage_in(wrapped, 0) is None
