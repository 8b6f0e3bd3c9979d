"""Resume never uses a damaged or hostile checkpoint: it loads the previous committed one, bitwise exact."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import structlog

from spotguard.hook import Hook
from spotguard.storage import open_storage
from spotguard.storage.commit import COMMIT_NAME, KEY_ENV, step_dir
from spotguard.storage.integrity import digest_of

from .test_boundary import assert_same, hooks, make, notice, one_iteration, reference, run_until_preempted  # noqa: F401

TOTAL = 10


class Evil:
    marker = ""

    def __reduce__(self) -> Any:
        import os

        return (os.system, (f"touch {self.marker}",))


def _two_commits(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    """Committed checkpoints at steps 3 and 6, from a run preempted twice."""
    s = make()
    run_until_preempted(hooks(s, tmp_path), s, TOTAL, 2, notice())
    s2 = make()
    exc = run_until_preempted(hooks(s2, tmp_path), s2, TOTAL, 5, notice())
    assert exc.committed and exc.step == 6


def _rewrite_record(folder: Path, name: str, data: bytes) -> None:
    """What an attacker with write access does: replace a file and make the record agree."""
    (folder / name).write_bytes(data)
    rec = json.loads((folder / COMMIT_NAME).read_text())
    rec["files"][name] = len(data)
    rec["bytes"] = sum(rec["files"].values())
    rec["checksums"][name] = digest_of(data).blocks
    rec.pop("hmac", None)
    (folder / COMMIT_NAME).write_text(json.dumps(rec))


def _damage(kind: str, folder: Path, marker: Path) -> str:
    shard = folder / "__0_0.distcp"
    if kind == "flip":
        b = bytearray(shard.read_bytes())
        b[len(b) // 2] ^= 0x01
        shard.write_bytes(bytes(b))
        return "crc32c mismatch"
    if kind == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
        return ""  # the record's size already refuses it (newest_committed skips it)
    if kind == "pickle":
        e = Evil()
        e.marker = str(marker)
        _rewrite_record(folder, ".metadata", pickle.dumps(e))
        return "forbidden global"
    if kind == "forged":  # flipped shard with a recomputed, unsigned record, under a job secret
        b = bytearray(shard.read_bytes())
        b[len(b) // 2] ^= 0x01
        _rewrite_record(folder, "__0_0.distcp", bytes(b))
        return ""
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flip", "truncate", "pickle", "forged"])
def test_damaged_newest_checkpoint_resumes_from_previous_bitwise(
        tmp_path: Path, hooks: Callable[..., Hook], monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "forged":
        monkeypatch.setenv(KEY_ENV, "job-secret")
    store = tmp_path / "store"
    ref = reference(TOTAL)
    _two_commits(store, hooks)
    marker = tmp_path / "pwned"
    expect = _damage(kind, store / step_dir(6), marker)
    s3 = make()
    h3 = hooks(s3, store)
    with structlog.testing.capture_logs() as logs:
        start = h3.resume()
    assert start == 3
    if expect:
        skipped = [e for e in logs if e["event"] == "skipping damaged checkpoint"]
        assert len(skipped) == 1 and skipped[0]["dir"] == step_dir(6) and expect in skipped[0]["problem"], logs
    for _ in range(start, TOTAL):
        one_iteration(s3)
    assert_same(ref, snapshot_of(s3))
    assert not marker.exists()


def snapshot_of(s: dict[str, Any]) -> dict[str, Any]:
    from .test_boundary import snapshot

    return snapshot(s)


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    _two_commits(tmp_path, hooks)
    for step in (3, 6):
        _damage("flip", tmp_path / step_dir(step), tmp_path / "m")
    h = hooks(make(), tmp_path)
    with pytest.raises(RuntimeError, match="no committed checkpoint .* passed verification"):
        h.resume()


def test_latest_skips_a_damaged_checkpoint(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    _two_commits(tmp_path, hooks)
    _damage("flip", tmp_path / step_dir(6), tmp_path / "m")
    h = hooks(make(), tmp_path)
    assert h.latest() == str(open_storage(str(tmp_path)).local_path(step_dir(3)))
