"""r24 review: retention deletes every good checkpoint when the quarantine mark is not seen.
Both failed before retention counted only checkpoints at or below the step just saved (review of issue 24).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .test_boundary import boundary_path, hooks, make, notice, run_until_preempted  # noqa: F401
from .test_integrity_resume import TOTAL, _damage, _two_commits
from spotguard.hook import Hook
from spotguard.storage.commit import scan, step_dir
from spotguard.storage.local import LocalStorage

QUARANTINE = "QUARANTINE.json"


class MarkWriteFails(LocalStorage):
    """An object store that answers 503 to the one small PUT of the mark (transient; everything else works)."""

    def write_bytes(self, key: str, data: bytes) -> None:
        if key.endswith(QUARANTINE):
            raise OSError("503 SlowDown (transient)")
        return super().write_bytes(key, data)


class MarkReadFailsAfterCommit(LocalStorage):
    """The mark is there, but one GET of it fails (503) at the moment retention runs (right after a commit)."""

    flaky = False

    def write_bytes(self, key: str, data: bytes) -> None:
        super().write_bytes(key, data)
        if key.endswith("COMMIT.json"):
            self.flaky = True

    def read_bytes(self, key: str) -> bytes:
        if self.flaky and key.endswith(QUARANTINE):
            self.flaky = False
            raise OSError("503 SlowDown (transient)")
        return super().read_bytes(key)


def _damaged_six(tmp: Path, hooks: Any) -> None:
    _two_commits(tmp, hooks)  # committed 3 and 6
    _damage("flip", tmp / step_dir(6), tmp / "unused")  # one flipped byte in 6's shard


def _life(storage: Any, keep: int) -> Any:
    s = make()
    with boundary_path():
        h = Hook(s, storage, signals=False, intake=False, keep=keep)
    try:
        return run_until_preempted(h, s, TOTAL, 4, notice())  # resumes 3 (6 damaged), commits 5
    finally:
        h.close()


def _states(tmp: Path) -> dict[int, str]:
    return {i.step: i.state for i in scan(LocalStorage(str(tmp)))}


def test_mark_write_fails_keep1_loses_everything(tmp_path: Path, hooks: Any) -> None:
    _damaged_six(tmp_path, hooks)
    exc = _life(MarkWriteFails(str(tmp_path)), keep=1)
    assert exc.committed and exc.step == 5  # the trainer is told: saved at 5
    # claim: keep counts verified checkpoints only -> 5 must survive
    assert _states(tmp_path).get(5) == "committed", _states(tmp_path)


def test_transient_mark_read_error_at_retention_loses_everything(tmp_path: Path, hooks: Any) -> None:
    _damaged_six(tmp_path, hooks)
    s = make()
    with boundary_path():
        h = Hook(s, str(tmp_path), signals=False, intake=False)
    assert h.resume() == 3  # first life: 6 verified in full, found damaged, quarantined
    h.close()
    assert _states(tmp_path)[6] == "quarantined"
    exc = _life(MarkReadFailsAfterCommit(str(tmp_path)), keep=1)
    assert exc.committed and exc.step == 5
    assert _states(tmp_path).get(5) == "committed", _states(tmp_path)
