"""Issue 25 review: a whole-job leave's failover (replica rank 1) next to a writer group that is slow, not dead.

In-process (``Preempted`` is raised, not ``os._exit``), the fake manager of ``_fallback_worker.py``. Two groups
share one storage; each process has its own lineage (neither resumed), as in a first run of a real job:

* the writer's commit lands at the takeover time (``deadline - lead``): before, the failover's save found the step
  "already committed by another run" and the group exited 75 although the step was in storage;
* the writer is still filling its step folder at the takeover time: before, the failover cleared that folder
  (``prepare_attempt``) and wrote over it — two saves of the same step racing.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

from spotguard.hook.core import Preempted  # noqa: E402
from spotguard.notice import Notice  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import newest_committed, step_dir  # noqa: E402
from spotguard.timefmt import utcnow  # noqa: E402
from spotguard.torchft import failover  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _fallback_worker as w  # noqa: E402

sys.path.pop(0)

STEP = 6


def _notice(seconds: float) -> Notice:
    now = utcnow()
    return Notice(id="n-whole-job", source="drill", kind="preemption", deadline=now + timedelta(seconds=seconds),
                  received_at=now)


def _group(tmp: Path, name: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A guard of replica rank ``rank`` at step ``STEP`` of a whole-job leave (its write pending)."""
    monkeypatch.setenv("REPLICA_RANK", str(rank))
    (tmp / name).mkdir()
    guard = w.build(str(tmp / "ckpt"), str(tmp / name / "none.sock"))[4]
    guard.hook._steps.set_count(STEP)
    guard._replica_rank = rank
    return guard


def _writer_commits(tmp: Path, monkeypatch: pytest.MonkeyPatch, seconds: float, name: str = "g0") -> None:
    """The other group (another lineage) writes and commits ``STEP`` (an early write: no look at the folder)."""
    guard = _group(tmp, name, 0, monkeypatch)
    with pytest.raises(Preempted) as left:
        guard.hook.emergency_exit(_notice(seconds), STEP, None)
    assert left.value.code == 143 and left.value.committed


def _leave(guard: Any, notice: Notice) -> Preempted:
    guard._pending = (notice, STEP, None)
    with pytest.raises(Preempted) as left:
        guard._write_pending()
    return left.value


def test_a_failover_whose_writer_commits_at_the_takeover_time_leaves_committed(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    g1 = _group(tmp_path, "g1", 1, monkeypatch)
    real = failover.await_commit

    def commit_lands_at_takeover(*a: Any, **k: Any) -> bool:
        _writer_commits(tmp_path, monkeypatch, 10)  # right after the last look: the wait ends without it
        monkeypatch.setattr(failover, "await_commit", real)
        return False

    monkeypatch.setattr(failover, "await_commit", commit_lands_at_takeover)
    left = _leave(g1, _notice(10))
    assert (left.code, left.committed) == (143, True)  # before: 75 ("already committed by another run")
    info = newest_committed(open_storage(str(tmp_path / "ckpt")))
    assert info is not None and info.step == STEP


@pytest.mark.parametrize("rank", [1, 0])
def test_a_second_save_does_not_clear_the_folder_of_a_save_still_writing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         rank: int) -> None:
    # rank 1: the failover at deadline - lead while the writer still writes; rank 0: the writer whose loop came
    # back after deadline - lead (a long evaluation) while the failover writes
    g1 = _group(tmp_path, "g1", rank, monkeypatch)
    storage = open_storage(str(tmp_path / "ckpt"))
    saves: list[float] = []
    own_save = g1.hook._save
    g1.hook._save = lambda *a, **k: (saves.append(time.monotonic()), own_save(*a, **k))[1]
    notice = _notice(4.0)  # lead 1.6 s: takeover 2.4 s from now, the deadline's margin at 3.5 s
    takeover = time.monotonic() + 4.0 - 1.6
    if rank == 0:  # the same 4 s notice, received 2.5 s ago: past its takeover time
        notice = Notice(id=notice.id, source=notice.source, kind=notice.kind, received_at=utcnow() - timedelta(
            seconds=2.5), deadline=utcnow() + timedelta(seconds=1.5))
        takeover = time.monotonic()
    writing = threading.Event()

    def slow_writer() -> None:  # the other group fills the step folder past the takeover time, then commits
        part = step_dir(STEP) + "/__0_0.distcp"
        data = b""
        while time.monotonic() < takeover + 0.6:
            data += b"x" * 4096
            storage.write_bytes(part, data)
            writing.set()
            time.sleep(0.1)
        _writer_commits(tmp_path, monkeypatch, 10, "g2")

    t = threading.Thread(target=slow_writer)
    t.start()
    try:
        writing.wait(5)
        left = _leave(g1, notice)
    finally:
        t.join(10)
    assert not saves, "a second save of the step while the first was still writing"  # before: at the takeover
    assert (left.code, left.committed) == (143, True)
    info = newest_committed(storage)
    assert info is not None and info.step == STEP


@pytest.mark.parametrize("rank", [1, 2])
def test_a_group_that_cannot_read_the_storage_never_claims_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    rank: int) -> None:
    # the waiting groups' storage is unreachable (their network, the bucket's permissions): they cannot see the
    # writer's commit, and rank 1's failover cannot write: both end with 75, never 143 "nothing lost"
    g = _group(tmp_path, f"g{rank}", rank, monkeypatch)

    def down(*a: Any, **k: Any) -> Any:
        raise OSError("storage unreachable")

    for name in ("exists", "list", "read_bytes", "write_bytes"):
        monkeypatch.setattr(g.hook._storage, name, down)
    codes: list[int] = []

    def hard_exit(notice: Notice, code: int, *a: Any, **k: Any) -> Any:
        codes.append(code)
        raise Preempted(code, notice_id=notice.id, step=STEP, committed=False)

    monkeypatch.setattr(g.hook, "_hard_exit", hard_exit)
    left = _leave(g, _notice(2.0))
    assert (left.code, left.committed) == (75, False)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_commit_of_the_step_by_an_earlier_run_is_not_taken_for_this_leave(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           rank: int) -> None:
    # the storage holds step 6 committed an hour ago by another run (same prefix, never resumed from): neither a
    # waiting group (rank 2) nor the writer (rank 0, whose save refuses the folder) may leave 143 on it
    import spotguard.storage.record as record  # noqa: PLC0415

    an_hour_ago = utcnow() - timedelta(hours=1)
    monkeypatch.setattr(record, "utcnow", lambda: an_hour_ago)
    _writer_commits(tmp_path, monkeypatch, 10, "old-run")
    monkeypatch.undo()
    g = _group(tmp_path, f"g{rank}", rank, monkeypatch)
    monkeypatch.setattr(g.hook, "_hard_exit", lambda notice, code, *a, **k: (_ for _ in ()).throw(
        Preempted(code, notice_id=notice.id, step=STEP, committed=False)))
    left = _leave(g, _notice(2.0))
    assert (left.code, left.committed) == (75, False)  # before: 143 committed (rank 2: "written by peer")
