"""Issue 23: a commit that lands after the notice's deadline is never reported as success.

On a real VM the machine is gone before such a commit; a drill cannot show that, so the hook must: a
``checkpoint_late`` warning, ``late: true`` with the seconds past in ``checkpoint_done`` (to the daemon),
in ``exit`` and on ``Preempted``, exit code 75 instead of 143, and ``spotguard checkpoints`` marks it LATE.
A drill's commit also says whether it would have beaten each cloud's real notice.
"""

from __future__ import annotations

import argparse
import io
import json
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import structlog

from spotguard.hook import Hook, Preempted, events
from spotguard.hook.settings import EXIT_SAVE_FAILED
from spotguard.notice import Notice
from spotguard.protocol import CheckpointDone, decode, encode
from spotguard.storage.listing import main as listing
from spotguard.timefmt import utcnow

from .test_boundary import hooks, make, one_iteration  # noqa: F401 - the fixture

__all__ = ["hooks"]


def _drill(seconds: float) -> Notice:
    now = utcnow()
    return Notice(id=f"drill-{uuid.uuid4().hex[:12]}", source="drill", kind="preemption",
                  deadline=now + timedelta(seconds=seconds), received_at=now)


def _run(h: Hook, s: dict[str, Any], n: Notice, slow_iteration: float) -> tuple[Preempted, list[Any], list[Any]]:
    """Notice in iteration 2; that iteration's work takes ``slow_iteration`` s (the boundary path acts at its end)."""
    reports: list[Any] = []
    h._report = reports.append  # type: ignore[method-assign] - what the intake would send to the daemon
    h.resume()
    with structlog.testing.capture_logs() as logs:
        try:
            for i in range(10):
                if i == 2:
                    h.notify(n)
                    time.sleep(slow_iteration)  # the iteration's own work (a long forward), not a synchronisation
                one_iteration(s)
        except Preempted as exc:
            return exc, [e for e in logs if e.get("component") == "hook"], reports
    raise AssertionError("the hook never acted on the notice")


def _listing(tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    out = io.StringIO()
    args = argparse.Namespace(uri=str(tmp_path), json=False, verify=False, restore=None, delete_quarantined=False)
    listing(args, out, io.StringIO())
    text = out.getvalue()
    out = io.StringIO()
    listing(argparse.Namespace(**{**vars(args), "json": True}), out, io.StringIO())
    return text, json.loads(out.getvalue())["checkpoints"]


def test_commit_after_the_deadline_is_late_and_exits_75(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    n = _drill(0.3)
    exc, logs, reports = _run(hooks(s, tmp_path), s, n, slow_iteration=0.6)
    assert exc.committed and exc.late and exc.code == EXIT_SAVE_FAILED, (exc.code, exc.committed, exc.late)
    risk = [e for e in logs if e["event"] == events.DEADLINE_AT_RISK]  # said at the notice, before acting
    assert len(risk) == 1 and risk[0]["estimate"] > risk[0]["seconds_left"], risk
    late = [e for e in logs if e["event"] == events.CHECKPOINT_LATE]
    assert len(late) == 1 and late[0]["log_level"] == "warning" and late[0]["seconds_past"] > 0.2
    (ex,) = [e for e in logs if e["event"] == events.EXIT]
    assert ex["late"] is True and ex["committed"] is True and ex["code"] == EXIT_SAVE_FAILED
    (done,) = [r for r in reports if isinstance(r, CheckpointDone)]
    assert done.late and done.seconds_past > 0.2
    wire = decode(encode(done))  # what the daemon reads
    assert isinstance(wire, CheckpointDone) and wire.late and wire.seconds_past == done.seconds_past
    text, rows = _listing(tmp_path)
    assert "LATE: committed" in text, text
    assert rows[-1]["late_seconds"] is not None and rows[-1]["late_seconds"] > 0.2
    (verdict,) = [e for e in logs if e["event"] == events.DRILL_VERDICT]
    assert verdict["would_beat"] == {"gcp": True, "azure": True, "aws": True}  # < 30 s: a real notice is longer


def test_commit_in_time_is_not_late(tmp_path: Path, hooks: Callable[..., Hook]) -> None:
    s = make()
    exc, logs, reports = _run(hooks(s, tmp_path), s, _drill(30.0), slow_iteration=0.0)
    assert exc.committed and not exc.late and exc.code == 143
    assert not [e for e in logs if e["event"] in (events.CHECKPOINT_LATE, events.DEADLINE_AT_RISK)]
    (ex,) = [e for e in logs if e["event"] == events.EXIT]
    assert ex["late"] is False
    (done,) = [r for r in reports if isinstance(r, CheckpointDone)]
    assert not done.late and done.seconds_past == 0.0
    text, rows = _listing(tmp_path)
    assert "LATE" not in text and rows[-1]["late_seconds"] is None
