"""torchft replica groups of two processes each (torchrun per group, gloo): the leave vote is the group's.

torchft reduces across groups rank by rank, so every rank of a group must vote alike although only the ranks
on the noticed node get the notice (issue 25: "replica groups of more than one process are untested"). Here
one rank of g1 gets SIGUSR1 (an emergency notice for that process only): both ranks of g1 must leave at the
same committed step, with the survivors' state at that step, and g0 (two processes) must train on to the end
without redoing or skipping a step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

from spotguard.torchft.launch import ReplicaJob, lighthouse_binary  # noqa: E402

if lighthouse_binary() is None:  # pragma: no cover - the wheel ships it
    pytest.skip("torchft_lighthouse not installed", allow_module_level=True)

START = 180.0  # two torchruns of two processes + the lighthouse on a loaded 2-core machine


def _steps(events: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "replica_step" and e.get("committed") and e.get("rank") == rank]


def test_one_rank_noticed_the_whole_group_leaves_at_one_step(short_tmp: Path) -> None:
    total = 40
    with ReplicaJob(short_tmp, groups=2, step_time=0.1, steps=total, procs=2) as j:
        g0, g1 = j.group("g0"), j.group("g1")
        for g in (g0, g1):
            for rank in (0, 1):
                got = g.wait_for(lambda e, r=rank: e.get("event") == "replica_step" and e.get("committed")
                                 and e.get("rank") == r and e["step"] >= 5, START)
                assert got is not None, f"{g.name} rank {rank} never reached step 5 (see {short_tmp})"
        pid = next(e["pid"] for e in g1.seen if e.get("event") == "replica_started" and e.get("rank") == 1)
        os.kill(pid, signal.SIGUSR1)  # rank 1 of g1 only: rank 0 never hears of it from spotguard
        exits = []
        for _ in range(2):
            ev = g1.wait_for(lambda e: e.get("event") == "replica_exit", 90)
            assert ev is not None, f"g1 did not leave (see {short_tmp})"
            exits.append(ev)
        g1.proc.wait(60)
        assert g0.proc.wait(START) == 0, f"g0 failed (see {short_tmp})"
        assert g0.wait_for(lambda e: e.get("event") == "replica_done", 30) is not None
    assert {e["rank"] for e in exits} == {0, 1} and {e["code"] for e in exits} == {143}
    assert len({e["step"] for e in exits}) == 1, exits  # one committed step for the whole group
    s = exits[0]["step"]
    for rank in (0, 1):
        left = [e for e in g1.seen if e.get("event") == "replica_left" and e.get("rank") == rank]
        assert left and left[0]["step"] == s
        seq = [e["step"] for e in _steps(g0.seen, rank)]
        assert seq[-1] >= total and seq == list(range(seq[0], seq[-1] + 1)), f"g0 rank {rank}: {seq}"
        at = {e["step"]: e for e in _steps(g0.seen, rank)}
        mine = next(e for e in exits if e["rank"] == rank)
        assert at[s]["digest"] == mine["digest"], "g1 left at a step g0 did not share"
        assert max(e["participants"] for e in _steps(g0.seen, rank) if e["step"] > s + 2) == 1
    # within g0 the two ranks hold one state (data parallel inside the group)
    assert [e["digest"] for e in _steps(g0.seen, 0)] == [e["digest"] for e in _steps(g0.seen, 1)]


def test_every_group_noticed_the_group_of_replica_rank_0_writes_with_both_processes(short_tmp: Path) -> None:
    from spotguard.storage import open_storage  # noqa: PLC0415
    from spotguard.storage.commit import newest_committed  # noqa: PLC0415

    with ReplicaJob(short_tmp, groups=2, step_time=0.1, steps=400, procs=2) as j:
        groups = j.group("g0"), j.group("g1")
        for g in groups:
            for rank in (0, 1):
                got = g.wait_for(lambda e, r=rank: e.get("event") == "replica_step" and e.get("committed")
                                 and e.get("rank") == r and e["step"] >= 5, START)
                assert got is not None, f"{g.name} rank {rank} never reached step 5 (see {short_tmp})"
        for g in groups:  # one rank of each group, the other hears it through its group's vote
            pid = next(e["pid"] for e in g.seen if e.get("event") == "replica_started" and e.get("rank") == 0)
            os.kill(pid, signal.SIGUSR1)
        exits = []
        for g in groups:
            for _ in range(2):
                ev = g.wait_for(lambda e: e.get("event") == "replica_exit", 90)
                assert ev is not None, f"{g.name} did not leave (see {short_tmp})"
                exits.append((g.name, ev))
            g.proc.wait(60)
    for name in ("g0", "g1"):  # each group leaves at one step with both its processes
        assert len({ev["step"] for n, ev in exits if n == name}) == 1, exits
    # the two signals may straddle a step: then the first group leaves as a peer and the last one writes
    s = max(ev["step"] for _, ev in exits)
    info = newest_committed(open_storage(str(short_tmp / "ckpt")))
    assert info is not None and info.step == s and info.record is not None
    assert info.record.world_size == 2  # written by both processes of one group (each its own RNG/loader part)
    codes = {ev["code"] for _, ev in exits}
    assert codes == {143}, exits
