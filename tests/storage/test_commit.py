"""Commit protocol: only a checkpoint whose record checks out is ever chosen, and retention is safe."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from spotguard.storage import StorageError, open_storage
from spotguard.storage.base import Storage
from spotguard.storage.commit import (
    COMMIT_NAME,
    FORMAT,
    LATEST_NAME,
    AlreadyCommitted,
    CommitRecord,
    apply_retention,
    commit,
    newest_committed,
    parse_step_dir,
    prepare_attempt,
    read_latest,
    scan,
    step_dir,
)


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Storage:
    return open_storage(str(tmp_path / "ckpt"))


def save(store: Storage, step: int, files: dict[str, bytes] | None = None, **kw: Any) -> CommitRecord:
    """What the hook does: prepare, write shards, commit."""
    key = prepare_attempt(store, step)
    files = files or {"__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 50, ".metadata": b"m" * 10}
    for name, data in files.items():
        store.write_bytes(f"{key}/{name}", data)
    return commit(store, step, CommitRecord(step=step, reason=kw.pop("reason", "emergency"), **kw))


def skipped(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "skipping checkpoint that cannot be loaded"]


def test_step_dir() -> None:
    assert step_dir(42) == "step-00000042"
    assert step_dir(123456789) == "step-123456789"
    assert parse_step_dir("step-00000042") == 42 and parse_step_dir("step-42") is None
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError):
            step_dir(bad)  # type: ignore[arg-type]


def test_commit_fills_files_writes_record_and_latest(store: Storage) -> None:
    rec = save(store, 7, world_size=2, notice_id="aws-abc", seconds=1.5)
    assert rec.files == {"__0_0.distcp": 100, "__1_0.distcp": 50, ".metadata": 10}
    assert rec.bytes == 160
    stored = CommitRecord.from_json(store.read_bytes(f"step-00000007/{COMMIT_NAME}"))
    assert stored == rec and stored.format == FORMAT and stored.notice_id == "aws-abc"
    assert read_latest(store) == "step-00000007"
    best = newest_committed(store)
    assert best is not None and best.step == 7 and best.committed and best.latest and best.bytes == 160


def test_commit_verifies_listed_sizes(store: Storage) -> None:
    key = prepare_attempt(store, 3)
    store.write_bytes(f"{key}/a", b"12345")
    with pytest.raises(StorageError, match="missing"):
        commit(store, 3, CommitRecord(step=3, files={"a": 5, "b": 1}, bytes=6))
    with pytest.raises(StorageError, match="expected 4"):
        commit(store, 3, CommitRecord(step=3, files={"a": 4}, bytes=4))
    assert not store.exists(f"{key}/{COMMIT_NAME}")
    with pytest.raises(ValueError, match="step"):
        commit(store, 3, CommitRecord(step=4))
    with pytest.raises(StorageError, match="nothing to commit"):
        commit(store, 9, CommitRecord(step=9))


def test_folder_without_commit_record_is_never_chosen(store: Storage) -> None:
    save(store, 10)
    key = prepare_attempt(store, 20)
    store.write_bytes(f"{key}/__0_0.distcp", b"x" * 100)
    store.write_bytes(f"{key}/.metadata", b"m")
    with capture_logs() as logs:
        best = newest_committed(store)
    assert best is not None and best.step == 10
    (line,) = skipped(logs)
    assert line["dir"] == "step-00000020" and "no commit record" in line["reason"]
    info = {i.step: i for i in scan(store)}
    assert not info[20].committed and info[20].state == "incomplete" and info[20].record is None


def _corrupt_missing(store: Storage, key: str) -> None:
    (store.local_path(key) / "__1_0.distcp").unlink()  # type: ignore[operator]


def _corrupt_truncated(store: Storage, key: str) -> None:
    p = store.local_path(key) / "__0_0.distcp"  # type: ignore[operator]
    p.write_bytes(p.read_bytes()[:37])


def _corrupt_garbage(store: Storage, key: str) -> None:
    (store.local_path(key) / COMMIT_NAME).write_bytes(b'{"format": 1, "step": \x00garbage')  # type: ignore[operator]


def _corrupt_step_mismatch(store: Storage, key: str) -> None:
    p = store.local_path(key) / COMMIT_NAME  # type: ignore[operator]
    doc = json.loads(p.read_text())
    doc["step"] = 5
    p.write_text(json.dumps(doc))


def _corrupt_empty_record(store: Storage, key: str) -> None:
    (store.local_path(key) / COMMIT_NAME).write_bytes(b"")  # type: ignore[operator]


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_corrupt_missing, "missing file __1_0.distcp"),
        (_corrupt_truncated, "truncated shard __0_0.distcp: 37 of 100 bytes"),
        (_corrupt_garbage, "garbage commit record"),
        (_corrupt_step_mismatch, "step mismatch"),
        (_corrupt_empty_record, "garbage commit record: commit record is empty"),
    ],
    ids=["missing", "truncated", "garbage", "step-mismatch", "empty-record"],
)
def test_bad_checkpoint_is_skipped_with_one_clear_log_line(store: Storage, corrupt: Any, reason: str) -> None:
    save(store, 10)
    save(store, 20)
    assert read_latest(store) == "step-00000020"
    corrupt(store, "step-00000020")
    with capture_logs() as logs:
        best = newest_committed(store)
    assert best is not None and best.step == 10 and best.committed
    lines = skipped(logs)
    assert len(lines) == 1, logs
    assert lines[0]["dir"] == "step-00000020" and reason in lines[0]["reason"]
    assert lines[0]["log_level"] == "warning"
    bad = {i.step: i for i in scan(store)}[20]
    assert not bad.committed and reason in (bad.problem or "") and bad.latest


def test_latest_pointing_at_incomplete_folder_is_ignored(store: Storage) -> None:
    save(store, 10)
    key = prepare_attempt(store, 30)
    store.write_bytes(f"{key}/__0_0.distcp", b"x")
    store.write_bytes(LATEST_NAME, b"step-00000030\n")
    with capture_logs() as logs:
        best = newest_committed(store)
    assert best is not None and best.step == 10 and not best.latest
    assert any(e["event"] == "latest hint ignored" for e in logs)


def test_latest_hint_garbage_or_missing_is_harmless(store: Storage) -> None:
    assert newest_committed(store) is None
    save(store, 4)
    store.write_bytes(LATEST_NAME, b"../../etc")
    assert read_latest(store) is None
    best = newest_committed(store)
    assert best is not None and best.step == 4


def test_latest_not_moved_backwards(store: Storage) -> None:
    save(store, 20)
    save(store, 10)  # an out-of-order commit (e.g. a slow periodic one)
    assert read_latest(store) == "step-00000020"


def test_prepare_attempt_clears_leftover_uncommitted_folder(store: Storage) -> None:
    key = prepare_attempt(store, 5)
    store.write_bytes(f"{key}/__0_0.distcp", b"old attempt")
    store.write_bytes(f"{key}/.metadata", b"old")
    assert prepare_attempt(store, 5) == "step-00000005"
    assert store.list("step-00000005/") == []


def test_prepare_attempt_and_commit_never_touch_a_committed_checkpoint(store: Storage) -> None:
    rec = save(store, 5)
    with pytest.raises(AlreadyCommitted) as exc:
        prepare_attempt(store, 5)
    assert exc.value.step == 5 and "already committed" in str(exc.value)
    with pytest.raises(AlreadyCommitted):
        commit(store, 5, CommitRecord(step=5))
    best = newest_committed(store)
    assert best is not None and best.record == rec


def test_retention(store: Storage) -> None:
    for step in (1, 2, 4, 5):
        save(store, step)
    store.write_bytes("step-00000003/__0_0.distcp", b"stale attempt")  # older than newest: stale
    store.write_bytes("step-00000009/__0_0.distcp", b"in progress")  # newer: maybe in flight
    deleted = apply_retention(store, keep=2)
    assert deleted == ["step-00000001", "step-00000002", "step-00000003"]
    assert [(i.step, i.committed) for i in scan(store)] == [(4, True), (5, True), (9, False)]
    assert apply_retention(store, keep=2) == []


def test_retention_never_deletes_newest_committed(store: Storage) -> None:
    save(store, 1)
    save(store, 2)
    _corrupt_truncated(store, "step-00000002")  # newest folder is bad: step 1 is the newest committed
    deleted = apply_retention(store, keep=1)
    assert "step-00000001" not in deleted
    best = newest_committed(store)
    assert best is not None and best.step == 1
    assert apply_retention(store, keep=None) == []
    with pytest.raises(ValueError):
        apply_retention(store, keep=0)


def test_retention_without_any_committed_deletes_nothing(store: Storage) -> None:
    store.write_bytes("step-00000001/x", b"partial")
    assert apply_retention(store, keep=1) == []
    assert store.exists("step-00000001/x")


# --- CommitRecord validation ----------------------------------------------------


def valid_doc() -> dict[str, Any]:
    return CommitRecord(step=3, files={"a": 1, "d/b": 2}, bytes=3, reason="periodic").to_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d.update(step="3"), "'step' must be an integer"),
        (lambda d: d.update(step=True), "'step' must be an integer"),
        (lambda d: d.update(step=-1), "'step' must be >= 0"),
        (lambda d: d.update(format=FORMAT + 1), "newer"),
        (lambda d: d.update(world_size=0), "'world_size' must be >= 1"),
        (lambda d: d.update(reason="because"), "reason"),
        (lambda d: d.update(created_at="yesterday"), "RFC 3339"),
        (lambda d: d.update(created_at="2026-01-01T00:00:00"), "RFC 3339"),
        (lambda d: d.update(files=[]), "'files' must be an object"),
        (lambda d: d.update(files={"../x": 1}, bytes=1), "not a safe relative path"),
        (lambda d: d.update(files={"a": -1}, bytes=-1), "non-negative"),
        (lambda d: d.update(files={COMMIT_NAME: 1}, bytes=1), "lists itself"),
        (lambda d: d.update(bytes=99), "does not equal"),
        (lambda d: d.update(seconds=-1), "seconds"),
        (lambda d: d.update(notice_id=5), "notice_id"),
        (lambda d: d.update(extra=[]), "'extra' must be an object"),
    ],
)
def test_from_json_names_the_problem(mutate: Any, message: str) -> None:
    doc = valid_doc()
    mutate(doc)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CommitRecord.from_json(json.dumps(doc))


def test_from_json_roundtrip_and_rejects_non_json() -> None:
    rec = CommitRecord.from_json(json.dumps(valid_doc()))
    assert CommitRecord.from_json(rec.to_json()) == rec
    for text in ("", "[]", "null", "{", '{"step": NaN}', b"\xff\xfe", "1e999999"):
        with pytest.raises(ValueError):
            CommitRecord.from_json(text)
    with pytest.raises(ValueError):
        CommitRecord(step=1, reason="nope").to_json()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = ["format", "step", "created_at", "world_size", "reason", "notice_id", "files", "bytes", "seconds",
          "spotguard_version", "extra"]


@st.composite
def near_valid_docs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid record with a few fields replaced by random JSON: exercises every type check."""
    doc = valid_doc()
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        if draw(st.booleans()):
            doc[name] = draw(json_values)
        else:
            doc.pop(name, None)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200),
    json_values.map(json.dumps),
    near_valid_docs().map(json.dumps),
))
def test_from_json_fuzz_raises_only_value_error(payload: Any) -> None:
    try:
        rec = CommitRecord.from_json(payload)
    except ValueError:
        return
    assert isinstance(rec, CommitRecord)
    assert CommitRecord.from_json(rec.to_json()) == rec  # whatever parses also re-serialises
