"""Issue 24, quarantine: a committed checkpoint that fails verification is set aside, and nothing counts it again.

Each case reproduces what an operator saw on the old code: retention deleting the
good checkpoints under a damaged newest one (keep=1), a later save at the damaged
step reported "already committed" while nothing loadable was there, every restart
reading the damaged checkpoint in full, and the plain listing naming it as what
resume would load.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any, Callable

import structlog

from spotguard.hook import Hook
from spotguard.storage.commit import scan, step_dir
from spotguard.storage.listing import main as listing_main
from spotguard.storage.local import LocalStorage

from .test_boundary import assert_same, hooks, make, notice, one_iteration, reference, run_until_preempted, snapshot  # noqa: F401
from .test_integrity_resume import TOTAL, _damage, _two_commits

QUARANTINE_NAME = "QUARANTINE.json"  # the mark (docs/storage.md); spelled here so this file runs on older code


def _damaged_six(store: Path, hooks: Callable[..., Hook]) -> None:
    """Committed steps 3 and 6 (keep=None), then a byte of step 6's shard flipped under its intact record."""
    _two_commits(store, hooks)
    _damage("flip", store / step_dir(6), store / "unused")


def test_keep1_save_after_skipping_damaged_newest_keeps_the_good_one(tmp_path: Path,
                                                                     hooks: Callable[..., Hook]) -> None:
    """Old code: the damaged 6 counted as newest, so keep=1 deleted 3 and 5, and the next resume had nothing."""
    _damaged_six(tmp_path, hooks)
    s = make()
    exc = run_until_preempted(hooks(s, tmp_path, keep=1), s, TOTAL, 4, notice())  # resumes 3, commits 5
    assert exc.committed and exc.step == 5
    states = {i.step: i.state for i in scan(LocalStorage(str(tmp_path)))}
    assert states == {5: "committed", 6: "quarantined"}, states  # keep=1 counts good ones only: 3 went
    s2 = make()
    assert hooks(s2, tmp_path, keep=1).resume() == 5
    for _ in range(5, TOTAL):
        one_iteration(s2)
    assert_same(reference(TOTAL), snapshot(s2))


def test_save_at_a_quarantined_step_really_commits(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    """Old code: the save at 6 hit "already committed", exited committed=True, and the next resume went back to 3."""
    _damaged_six(tmp_path, hooks)
    s = make()
    with structlog.testing.capture_logs() as logs:
        exc = run_until_preempted(hooks(s, tmp_path), s, TOTAL, 5, notice())  # resumes 3, saves at 6
    assert exc.committed and exc.step == 6
    s2 = make()
    assert hooks(s2, tmp_path).resume() == 6
    assert any(e["event"].startswith("replacing a checkpoint that cannot be loaded") for e in logs), logs
    info = {i.step: i for i in scan(LocalStorage(str(tmp_path)))}[6]
    assert info.state == "committed" and not (tmp_path / step_dir(6) / QUARANTINE_NAME).exists()
    for _ in range(6, TOTAL):
        one_iteration(s2)
    assert_same(reference(TOTAL), snapshot(s2))


class CountingStorage(LocalStorage):
    """The file backend, counting what is read from each checkpoint folder (DCP readers opened, bytes read)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.readers: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def dcp_reader(self, key: str, digests: Any = None) -> Any:
        self.readers[key] = self.readers.get(key, 0) + 1
        return super().dcp_reader(key, digests)

    def read_bytes(self, key: str) -> bytes:
        data = super().read_bytes(key)
        self.bytes[key.split("/")[0]] = self.bytes.get(key.split("/")[0], 0) + len(data)
        return data

    def read_range(self, key: str, start: int, end: int) -> bytes:
        data = super().read_range(key, start, end)
        self.bytes[key.split("/")[0]] = self.bytes.get(key.split("/")[0], 0) + len(data)
        return data


def _resume_on(storage: LocalStorage) -> int:
    h = Hook(make(), storage, signals=False, intake=False)
    try:
        return h.resume()
    finally:
        h.close()


def test_restart_reads_the_damaged_checkpoint_in_full_only_once(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    """Old code: every restart opened step 6's shards again before falling back to 3."""
    _damaged_six(tmp_path, hooks)
    first = CountingStorage(str(tmp_path))
    assert _resume_on(first) == 3
    assert first.readers.get(step_dir(6), 0) >= 1  # the one full read, which found the damage
    again = CountingStorage(str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        assert _resume_on(again) == 3
    assert again.readers.get(step_dir(6), 0) == 0, again.readers
    assert again.bytes.get(step_dir(6), 0) < 4096, again.bytes  # its record and mark only, never a shard
    assert any(e["event"] == "skipping quarantined checkpoint" and e["dir"] == step_dir(6) for e in logs), logs


def _listing(store: Path) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert listing_main(argparse.Namespace(uri=str(store), json=False, verify=False), out, err) == 0, err.getvalue()
    return out.getvalue()


def test_plain_listing_never_claims_resume_loads_a_damaged_checkpoint(tmp_path: Path,
                                                                     hooks: Callable[..., Hook]) -> None:
    """Old code: "committed, newest, latest — resume would load step-00000006" for a flipped shard byte."""
    _damaged_six(tmp_path, hooks)
    before = _listing(tmp_path)
    assert "resume would load" not in before, before
    row6 = next(line for line in before.splitlines() if line.split() and line.split()[0] == "6")
    assert "not verified: resume verifies it first" in row6, before
    assert "resume would try step-00000006 first: committed, not verified" in before
    assert hooks(make(), tmp_path).resume() == 3  # sets 6 aside
    after = _listing(tmp_path)
    row6 = next(line for line in after.splitlines() if line.split() and line.split()[0] == "6")
    assert "QUARANTINED (crc32c mismatch" in row6 and "by resume at" in row6, after
    assert "resume would try step-00000003 first" in after and "quarantined (never loaded" in after, after
    assert (tmp_path / "latest").read_text().strip() == step_dir(3)  # the hint moved off the quarantined one


def test_everything_quarantined_stays_a_clear_error(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    """Quarantined work is never silently replaced by a start from step 0 on the next restart."""
    _two_commits(tmp_path, hooks)
    for step in (3, 6):
        _damage("flip", tmp_path / step_dir(step), tmp_path / "m")
    for _ in range(2):  # the first restart sets both aside, the second finds them set aside
        h = hooks(make(), tmp_path)
        try:
            h.resume()
        except RuntimeError as exc:
            assert "passed verification" in str(exc) and step_dir(6) in str(exc) and "--delete-quarantined" in str(exc)
        else:
            raise AssertionError("resume started over quarantined checkpoints")
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(uri=str(tmp_path), json=False, verify=False, restore=None, delete_quarantined=True)
    assert listing_main(args, out, err) == 0 and "deleted 2 quarantined" in out.getvalue()
    assert hooks(make(), tmp_path).resume() == 0


def test_garbage_marks_never_hide_a_good_checkpoint_nor_crash_resume(tmp_path: Path,
                                                                     hooks: Callable[..., Hook]) -> None:
    """A mark is untrusted: a garbage one on the good newest is ignored (verified in full, loaded); a garbage
    one on a damaged checkpoint is replaced by a real one when resume finds the damage."""
    _two_commits(tmp_path, hooks)
    (tmp_path / step_dir(6) / QUARANTINE_NAME).write_bytes(b'{"format": 1, "step": "six"}')
    (tmp_path / step_dir(3) / QUARANTINE_NAME).write_bytes(b"\x00garbage")
    with structlog.testing.capture_logs() as logs:
        assert hooks(make(), tmp_path).resume() == 6
    assert any(e["event"].startswith("quarantine mark ignored") and e["dir"] == step_dir(6) for e in logs), logs
    _damage("flip", tmp_path / step_dir(6), tmp_path / "unused")
    assert hooks(make(), tmp_path).resume() == 3  # 3's garbage mark is ignored too: it verifies and loads
    states = {i.step: i.state for i in scan(LocalStorage(str(tmp_path)))}
    assert states == {3: "committed", 6: "quarantined"}, states
