"""The notice book's rules, without sockets."""

from __future__ import annotations

from datetime import timedelta

from spotguard.daemon.book import NoticeBook
from spotguard.protocol import Ack, CheckpointDone, CheckpointFailed, CheckpointStarted
from spotguard.timefmt import utcnow

from .conftest import make_notice


def test_dedup_by_id_and_bounded_memory() -> None:
    book = NoticeBook(remember=3)
    assert book.add(make_notice("a")) is not None
    for _ in range(100):
        assert book.add(make_notice("a")) is None
    assert book.total == 1
    for nid in ("b", "c", "d", "e"):
        book.add(make_notice(nid))
    assert len(book._seen) == 3  # bounded


def test_cancel_removes_once() -> None:
    book = NoticeBook()
    book.add(make_notice("a"))
    assert book.cancel("a") is not None
    assert book.cancel("a") is None
    assert book.notices() == []
    assert book.add(make_notice("a")) is None  # a withdrawn id is not resurrected by a stale poll


def test_expiry_after_deadline_plus_margin() -> None:
    book = NoticeBook(expire_margin=60)
    book.add(make_notice("past", in_seconds=-30))
    book.add(make_notice("old", in_seconds=-61))
    book.add(make_notice("future", in_seconds=30))
    gone = book.expire()
    assert [e.id for e in gone] == ["old"]
    assert {n.id for n in book.notices()} == {"past", "future"}
    assert [e.id for e in book.expire(utcnow() + timedelta(seconds=200))] == ["past", "future"]


def test_states_never_move_back_and_unknown_ids_ignored() -> None:
    book = NoticeBook()
    book.add(make_notice("a"))
    book.queued("a", 1, live=True)
    entry = book.delivered("a", 1, 0.001)
    assert entry is not None and entry.latencies == [0.001]
    assert book.record(1, Ack(id="a"))[1]
    assert book.record(1, CheckpointStarted(id="a", step=7))[1]
    assert book.record(1, CheckpointDone(id="a", step=7, uri="file:///x", bytes=10, seconds=1.5))[1]
    assert not book.record(1, Ack(id="a"))[1]
    assert not book.record(1, CheckpointFailed(id="a", error="late"))[1]
    rep = book.get("a").reports[1]
    assert (rep.state, rep.step, rep.bytes, rep.seconds) == ("checkpoint_done", 7, 10, 1.5)
    assert book.record(1, Ack(id="nope")) == (None, False)
    assert book.client_finished(1)


def test_approval_needs_every_recipient_done() -> None:
    book = NoticeBook()
    e = book.add(make_notice("az", source="azure"))
    assert not book.ready_for_approval(e)  # nobody got it
    book.queued("az", 1, live=True)
    book.queued("az", 2, live=True)
    book.record(1, CheckpointDone(id="az", step=1))
    assert not book.ready_for_approval(e)
    book.record(2, CheckpointDone(id="az", step=1))
    assert book.ready_for_approval(e)
    e.approved = True
    assert not book.ready_for_approval(e)  # once


def test_approval_blocked_by_failure_or_silent_departure() -> None:
    book = NoticeBook()
    e = book.add(make_notice("az", source="azure"))
    book.queued("az", 1, live=True)
    book.queued("az", 2, live=True)
    book.record(1, CheckpointDone(id="az", step=1))
    book.client_gone(2)
    assert not book.ready_for_approval(e)
    e2 = book.add(make_notice("az2", source="azure"))
    book.queued("az2", 1, live=True)
    book.record(1, CheckpointFailed(id="az2", error="disk"))
    assert not book.ready_for_approval(e2)


def test_rebalance_done_does_not_count_as_finished() -> None:
    book = NoticeBook()
    book.add(make_notice("r", kind="rebalance"))
    book.record(1, CheckpointDone(id="r", step=1))
    assert not book.client_finished(1)


def test_client_gone_completes_pending_broadcast() -> None:
    book = NoticeBook()
    book.add(make_notice("a"))
    book.queued("a", 1, live=True)
    book.queued("a", 2, live=True)
    assert book.delivered("a", 1, 0.002) is None
    finished = book.client_gone(2)
    assert [e.id for e in finished] == ["a"]
