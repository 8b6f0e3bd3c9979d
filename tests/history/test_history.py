"""The history's record, writer and reader on a real local store (no mocks of the store's semantics)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spotguard.history import Event, HistoryWriter, LogTap, read_history
from spotguard.history.record import MAX_BYTES, BadEntry, event_key, parse_key
from spotguard.storage import open_storage
from spotguard.storage.local import LocalStorage


class _Log:
    """The inner logger: records what it was asked to log."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))

    def error(self, event: str, **kw: Any) -> None:
        self.lines.append(("error", event, kw))


def test_round_trip_through_the_store_in_time_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import spotguard.history.writer as writer  # noqa: PLC0415

    monkeypatch.setattr(writer, "_STARTED_PIDS", {})  # this writer is the process's first hook (only it has a start)
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    inner = _Log()
    log = LogTap(inner, w)
    log.info("hook_installed", world_size=2, objects={"model": "model"})
    log.info("notice_seen", notice_id="n1", source="aws", kind="preemption", deadline="2026-01-01T00:00:00Z")
    log.info("a line the history does not keep", x=1)
    log.info("exit", code=143, step=7, committed=True, seconds_left=30.0)  # flushes before returning
    assert [e for _, e, _ in inner.lines] == ["hook_installed", "notice_seen", "a line the history does not keep",
                                               "exit"]
    assert w.written == 3
    h = read_history(store)
    assert [e.kind for e in h.events] == ["hook_installed", "notice_seen", "exit"] and h.skipped == []
    assert h.events[2].fields["code"] == 143 and h.events[0].fields["process_started"] > 0
    assert {e.run for e in h.events} == {w.run}
    assert "history/" in [k[:8] for k in (o.key for o in store.list("history/"))]


def test_job_wide_events_only_from_rank0_and_node_events_from_local_leaders(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    r1 = HistoryWriter(store, rank=1, local_rank=1)
    r2 = HistoryWriter(store, rank=2, local_rank=0)
    assert not r1.wants("checkpoint_committed") and not r2.wants("checkpoint_committed")
    assert r1.wants("notice_seen") and not r1.wants("exit") and r2.wants("exit")
    assert HistoryWriter(store, rank=0, local_rank=0).wants("checkpoint_committed")
    assert not r2.wants("loss")


def test_oversized_fields_are_cut_to_the_bound() -> None:
    ev = Event(kind="exit", time=1.7e9, run="0123456789ab", rank=0,
               fields={"code": 143, "error": "x" * 100_000, "many": [{"k": "y" * 299}] * 1000})
    data = ev.to_json()
    assert len(data) <= MAX_BYTES
    back = Event.from_json(data)
    assert back.fields["code"] == 143 and back.fields.get("truncated") is True


@pytest.mark.parametrize("body,why", [
    (b"\x00\xff", "not JSON"),
    (b"[]", "not a JSON object"),
    (json.dumps({"v": 99, "kind": "exit"}).encode(), "version 99"),
    (json.dumps({"v": 1, "kind": "rm -rf", "time": 1.7e9, "run": "0123456789ab", "rank": 0}).encode(), "unknown kind"),
    (json.dumps({"v": 1, "kind": "exit", "time": "now", "run": "0123456789ab", "rank": 0}).encode(), "epoch"),
    (json.dumps({"v": 1, "kind": "exit", "time": 1.7e9, "run": "../x", "rank": 0}).encode(), "hex"),
    (json.dumps({"v": 1, "kind": "exit", "time": 1.7e9, "run": "0123456789ab", "rank": -1}).encode(), "rank"),
    (b'{"v": 1, "time": NaN}', "not JSON"),
])
def test_bad_bodies_are_refused_with_the_reason(body: bytes, why: str) -> None:
    with pytest.raises(BadEntry, match=why):
        Event.from_json(body)


def test_damaged_and_foreign_entries_are_skipped_and_named(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    w.record("hook_installed", {"world_size": 1})
    w.record("exit", {"code": 143})
    assert w.flush(5)
    good = sorted(o.key for o in store.list("history/"))
    store.write_bytes(good[0], store.read_bytes(good[0])[:-5])  # damaged: truncated body
    store.write_bytes("history/notes.txt", b"hello")  # foreign name
    store.write_bytes(event_key(1.7e9, "ffffffffffff", 3, 1), Event(  # body and key disagree
        kind="exit", time=1.7e9, run="0123456789ab", rank=3).to_json())
    store.write_bytes(event_key(1.7e9, "eeeeeeeeeeee", 0, 1), b"x" * (MAX_BYTES + 1))  # oversized
    link = event_key(1.7e9, "dddddddddddd", 0, 1)
    (tmp_path / link).symlink_to(tmp_path / good[1])  # a link, even to a valid entry, is never read
    h = read_history(store)
    assert [e.kind for e in h.events] == ["exit"]
    skipped = dict(h.skipped)
    assert set(skipped) == {good[0], "history/notes.txt", event_key(1.7e9, "ffffffffffff", 3, 1),
                            event_key(1.7e9, "eeeeeeeeeeee", 0, 1)}  # the store's listing never shows a link
    assert "not JSON" in skipped[good[0]] and "not a history entry name" in skipped["history/notes.txt"]
    assert "body names run" in skipped[event_key(1.7e9, "ffffffffffff", 3, 1)]
    assert "bytes (at most" in skipped[event_key(1.7e9, "eeeeeeeeeeee", 0, 1)]
    with pytest.raises(BadEntry):
        parse_key("history/../step-00000001/COMMIT.json")


class _BrokenStore(LocalStorage):
    def write_bytes(self, key: str, data: bytes) -> None:
        raise OSError("disk on fire")


class _StalledStore(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def write_bytes(self, key: str, data: bytes) -> None:
        self.release.wait(10)
        super().write_bytes(key, data)


def test_a_failing_store_costs_entries_never_the_caller(tmp_path: Path) -> None:
    w = HistoryWriter(_BrokenStore(str(tmp_path)), rank=0)
    log = LogTap(_Log(), w)
    log.info("checkpoint_committed", step=3, bytes=10)
    log.info("exit", code=143, seconds_left=5.0)
    assert w.written == 0 and w.flush(1)
    assert any(k.startswith("write:OSError") for k in w._warned)


@pytest.mark.serial
def test_a_stalled_store_never_blocks_recording_and_bounds_the_exit_flush(tmp_path: Path) -> None:
    store = _StalledStore(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    import time

    t0 = time.monotonic()
    for i in range(2000):  # more than the queue holds: the rest is dropped, counted
        w.record("agreed", {"step": i})
    assert time.monotonic() - t0 < 1.0
    assert w.dropped > 0
    t0 = time.monotonic()
    LogTap(_Log(), w).info("exit", code=143, seconds_left=0.3)  # bound: max(0.05, 0.3 - 0.5)
    assert time.monotonic() - t0 < 0.5
    store.release.set()


def test_entries_wait_while_a_notice_save_is_in_flight(tmp_path: Path) -> None:
    """Between a notice and its commit the writer does no I/O: the save has the store to itself."""
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    w.record("notice_seen", {"notice_id": "n1"})
    w.record("agreed", {"notice_id": "n1", "step": 3})
    assert not w.flush(0.3) and store.list("history/") == []
    w.record("checkpoint_committed", {"notice_id": "n1", "step": 3})
    assert w.flush(5) and len(store.list("history/")) == 3


def test_a_rank_that_writes_only_its_notice_is_released_by_rank0s_commit(tmp_path: Path) -> None:
    """Rank 1 (not a leader) writes notice_seen only; the commit it logs but does not write ends its hold."""
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=1, local_rank=1)
    log = LogTap(_Log(), w)
    log.info("notice_seen", notice_id="n1", source="signal", kind="termination")
    log.info("checkpoint_committed", notice_id="n1", step=3, bytes=1)
    assert w.flush(5) and [o.key.split("-")[-2] for o in store.list("history/")] == ["00001"]


def test_the_hold_ends_before_the_notice_deadline(tmp_path: Path) -> None:
    """A save too slow for its deadline: the entries go out 2 s before it, while the VM still exists."""
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    w.record("notice_seen", {"notice_id": "n1", "seconds_left": 2.4})
    w.record("checkpoint_started", {"notice_id": "n1", "step": 3})  # no deadline in it: the hold stays as it is
    assert not w.flush(0.1)
    assert w.flush(3) and len(store.list("history/")) == 2


def test_a_long_run_of_periodic_checkpoints_never_crowds_out_the_preemption(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Weeks of periodic checkpoints reach the per-process cap; the notice, its save and the exit still go out."""
    import spotguard.history.writer as writer  # noqa: PLC0415

    monkeypatch.setattr(writer, "MAX_EVENTS", 40)
    store = open_storage(str(tmp_path))
    w = HistoryWriter(store, rank=0)
    w.record("hook_installed", {"world_size": 1})
    for step in range(100):
        w.record("periodic_committed", {"step": step, "bytes": 1, "seconds": 0.1})
    for k in range(30):  # a storm of notices on top
        w.record("notice_seen", {"notice_id": f"r-{k}", "source": "aws", "kind": "rebalance"})
    for kind in ("notice_seen", "agreed", "checkpoint_committed", "exit"):
        w.record(kind, {"notice_id": "n-1", "step": 100, "action": "emergency", "code": 143})
    assert w.flush(10)
    kinds = [e.kind for e in read_history(store).events]
    assert kinds[-3:] == ["agreed", "checkpoint_committed", "exit"]
    assert kinds.count("periodic_committed") <= 30 and len(kinds) <= 41 and w.dropped > 0


def test_alive_is_rewritten_with_the_step_and_the_process_end_still_writes_its_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet process's ``alive`` entry follows its step (not only its first value), and writing it never counts
    as the attempt's end: ``close()`` still records ``exit`` (``process_end``)."""
    monkeypatch.setenv("SPOTGUARD_HISTORY_ALIVE", "0.05")
    store = open_storage(str(tmp_path))
    step = [1]
    w = HistoryWriter(store, rank=0, step_of=lambda: step[0])
    w.record("hook_installed", {"world_size": 1})
    assert w.flush(5.0)

    def alive_step() -> Any:
        got = [e for e in read_history(store).events if e.kind == "alive"]
        return got[0].fields.get("step") if got else None

    deadline = time.monotonic() + 10
    while alive_step() != 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the store the writer thread writes to: nothing to await
    step[0] = 2
    while alive_step() != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert alive_step() == 2, "the alive entry was written once and never again"
    w.close()
    exits = [e for e in read_history(store).events if e.kind == "exit"]
    assert [e.fields.get("reason") for e in exits] == ["process_end"] and exits[0].fields.get("step") == 2
