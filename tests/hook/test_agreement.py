"""The notice every rank acts on after agreeing: the best candidate, or the stand-in when none is left."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spotguard.hook.agreement import agreed_notice, best_candidate
from spotguard.hook.dist import NO_DEADLINE_MS
from spotguard.hook.settings import SIGNAL_GRACE, _ms
from spotguard.notice import Notice
from spotguard.timefmt import utcnow


def _cand(nid: str, level: int, in_s: float) -> tuple[int, int, dict[str, object]]:
    n = Notice(id=nid, source="aws", kind="termination", deadline=utcnow() + timedelta(seconds=in_s))
    return level, _ms(n.deadline), n.to_wire()


def test_best_candidate_takes_the_highest_level_then_the_earliest_deadline() -> None:
    late, early, soft = _cand("late", 2, 100), _cand("early", 2, 20), _cand("soft", 1, 5)
    assert best_candidate([None, late, soft, early, None]).id == "early"  # type: ignore[union-attr]
    assert best_candidate([soft, None]).id == "soft"  # type: ignore[union-attr]
    assert best_candidate([None, None]) is None


@pytest.mark.serial
def test_agreed_notice_keeps_the_agreed_deadline_and_never_one_in_the_past() -> None:
    t0 = utcnow()
    n = agreed_notice(7, _ms(t0) + 45_000, "notice withdrawn after agreement")  # not SIGNAL_GRACE (30)
    assert (n.id, n.source, n.kind, n.detail) == ("agreed-7", "signal", "termination",
                                                  "notice withdrawn after agreement")
    assert abs((n.deadline - t0).total_seconds() - 45) < 1
    past = agreed_notice(7, _ms(t0) - 60_000)
    assert 0 <= (past.deadline - past.received_at).total_seconds() < 0.01  # due now, not a minute ago


@pytest.mark.serial
def test_agreed_notice_without_a_deadline_gets_the_signal_grace() -> None:
    for no_deadline in (None, NO_DEADLINE_MS):
        n = agreed_notice(3, no_deadline)
        assert abs((n.deadline - n.received_at).total_seconds() - SIGNAL_GRACE) < 0.01
