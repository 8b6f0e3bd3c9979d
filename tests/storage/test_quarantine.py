"""The quarantine mark is untrusted data: it only ever applies to the record it judged, and bad ones are ignored.

A mark can only make resume skip a checkpoint, so a garbage, stale, oversized or
(under ``$SPOTGUARD_COMMIT_KEY``) unsigned one is logged and ignored: the
checkpoint is then verified in full, which is always safe. The operator's
``--restore`` lifts a mark only after a full re-verify; ``--delete-quarantined``
deletes them; a commit record can never name the mark as one of its files.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from spotguard.storage import open_storage
from spotguard.storage.commit import (
    KEY_ENV,
    QUARANTINE_NAME,
    CommitRecord,
    apply_retention,
    checkpoint_info,
    newest_committed,
    quarantine_dir,
    scan,
    step_dir,
)
from spotguard.storage.listing import main as listing_main
from spotguard.storage.quarantine import QuarantineMark

from .test_integrity import _flip, _save


def _store(tmp_path: Path, steps: tuple[int, ...] = (1, 2)) -> Any:
    store = open_storage(str(tmp_path))
    for s in steps:
        _save(store, s, scale=float(s))
    return store


def _cli(tmp_path: Path, **kw: Any) -> tuple[int, str, str]:
    args = argparse.Namespace(uri=str(tmp_path), json=kw.pop("json", False), verify=kw.pop("verify", False),
                              restore=kw.pop("restore", None), delete_quarantined=kw.pop("delete", False))
    out, err = io.StringIO(), io.StringIO()
    code = listing_main(args, out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("content", [
    b"", b"\xff\xfe not utf-8", b"[]", b'{"format": 1}', b"{" * 100_000, b'{"format": 1, "step": NaN}',
    b"x" * 70_000,
])
def test_garbage_mark_is_ignored_and_the_checkpoint_still_loads(tmp_path: Path, content: bytes) -> None:
    store = _store(tmp_path)
    (tmp_path / step_dir(2) / QUARANTINE_NAME).write_bytes(content)
    with structlog.testing.capture_logs() as logs:
        info = newest_committed(store)
    assert info is not None and info.step == 2 and info.quarantine is None and info.mark_ignored
    assert any(e["event"].startswith("quarantine mark ignored") for e in logs), logs
    code, out, _ = _cli(tmp_path)
    assert code == 0 and "quarantine mark ignored" in out and "resume would try step-00000002 first" in out
    assert QUARANTINE_NAME not in str(info.unlisted)  # not reported as a stray object either


def test_stale_mark_from_another_record_is_ignored(tmp_path: Path) -> None:
    """A mark names the SHA-256 of the record it judged: a save that replaced the record is not hidden by it."""
    store = _store(tmp_path)
    assert quarantine_dir(store, step_dir(2), "crc32c mismatch", "x", "test")
    assert checkpoint_info(store, step_dir(2)).state == "quarantined"
    rec = json.loads((tmp_path / step_dir(2) / "COMMIT.json").read_text())
    rec["seconds"] = 1.5  # another record, still valid
    (tmp_path / step_dir(2) / "COMMIT.json").write_text(json.dumps(rec))
    info = checkpoint_info(store, step_dir(2))
    assert info.committed and info.quarantine is None and "another commit record" in (info.mark_ignored or "")


def test_forged_mark_on_a_good_checkpoint_is_ignored_under_the_job_key(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "job-secret")
    store = _store(tmp_path)
    info = checkpoint_info(store, step_dir(2))
    forged = QuarantineMark(step=2, record_sha256=info.record_sha256 or "", reason="crc32c mismatch")
    (tmp_path / step_dir(2) / QUARANTINE_NAME).write_text(forged.to_json())  # unsigned
    info = checkpoint_info(store, step_dir(2))
    assert info.committed and "not signed" in (info.mark_ignored or "")
    forged.sign(b"other-key")
    (tmp_path / step_dir(2) / QUARANTINE_NAME).write_text(forged.to_json())
    assert "does not match" in (checkpoint_info(store, step_dir(2)).mark_ignored or "")
    assert quarantine_dir(store, step_dir(2), "crc32c mismatch", "x", "test")  # a real one, signed with the key
    assert checkpoint_info(store, step_dir(2)).state == "quarantined"


def test_a_record_can_never_name_the_mark_as_a_file() -> None:
    with pytest.raises(ValueError, match="quarantine mark"):
        CommitRecord(step=1, files={QUARANTINE_NAME: 3}, bytes=3).validate()


def test_retention_keeps_quarantined_and_counts_good_ones_only(tmp_path: Path) -> None:
    store = _store(tmp_path, (1, 2, 3, 4))
    quarantine_dir(store, step_dir(4), "crc32c mismatch", "x", "test")
    quarantine_dir(store, step_dir(2), "crc32c mismatch", "x", "test")
    assert apply_retention(store, 1) == [step_dir(1)]  # keep=1 over the good 1 and 3; both marks kept
    assert {i.step: i.state for i in scan(store)} == {2: "quarantined", 3: "committed", 4: "quarantined"}


def test_verify_quarantines_restore_and_delete(tmp_path: Path) -> None:
    _store(tmp_path)
    shard = tmp_path / step_dir(2) / "__0_0.distcp"
    good = shard.read_bytes()
    _flip(shard)
    code, out, _ = _cli(tmp_path, verify=True)
    assert code == 1 and "DAMAGED, quarantined" in out and "resume would load step-00000001" in out
    assert (tmp_path / step_dir(2) / QUARANTINE_NAME).exists()
    code, out, _ = _cli(tmp_path, json=True)
    doc = json.loads(out)
    assert doc["quarantined"] == [step_dir(2)] and doc["newest_committed"] == step_dir(1)
    assert doc["checkpoints"][1]["state"] == "quarantined" and doc["checkpoints"][1]["quarantine"]["by"] == \
        "checkpoints --verify"
    code, _, err = _cli(tmp_path, restore=2)  # still damaged: the mark stays
    assert code == 1 and "still fails verification" in err
    assert checkpoint_info(open_storage(str(tmp_path)), step_dir(2)).state == "quarantined"
    code, _, err = _cli(tmp_path, restore=1)
    assert code == 1 and "not quarantined" in err
    shard.write_bytes(good)  # the operator repaired it from a backup
    code, out, _ = _cli(tmp_path, restore=2)
    assert code == 0 and "quarantine lifted" in out
    assert newest_committed(open_storage(str(tmp_path))).step == 2  # type: ignore[union-attr]
    _flip(shard)
    _cli(tmp_path, verify=True)
    code, out, _ = _cli(tmp_path, delete=True)
    assert code == 0 and f"deleted 1 quarantined checkpoint(s): {step_dir(2)}" in out
    assert [i.step for i in scan(open_storage(str(tmp_path)))] == [1]
