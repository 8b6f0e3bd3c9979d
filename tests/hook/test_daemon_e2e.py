"""End to end with REAL daemons and ``torchrun`` (2 ranks, gloo, CPU): drill, two nodes, daemon restart, replay.

Unlike ``test_torchrun.py`` (signals, no daemon), every notice here travels the
product's path: ``spotguard drill`` -> daemon -> socket -> the hook's intake ->
agreement -> DCP checkpoint -> commit -> ``checkpoint_done`` report back to the
daemon -> exit 143. Every wait is on a condition (a log line, a ``status``
reply), never a fixed sleep.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from spotguard.launch import DaemonProc, query_status
from spotguard.storage import open_storage
from spotguard.storage.commit import scan

from ._daemons import (
    RANK_SOCKET_LAUNCHER,
    ScriptRun,
    active_notice,
    drill,
    running_daemon,
    status_cli,
    wait_subscribed,
)
from ._torchrun import TorchRun, reference_run
from .test_torchrun import STEPS, assert_agreed_exit, committed, resume_to_end

# STEPS (30, shared with resume_to_end): 30 x 0.15 s leaves room for the drill to land mid-run
STEP_TIME = "0.15"
LONG = ["--steps", "600", "--step-time", "0.05"]  # runs that never reach their end (drilled first)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, same code path without spotguard."""
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def step_folders(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.name.startswith("step-")) if store.exists() else []


def commit_record(store: Path, step: int) -> Any:
    [info] = [c for c in scan(open_storage(str(store))) if c.step == step and c.committed]
    return info.record


def assert_daemon_saw_done(sock: str, notice_id: str, ranks: set[int], step: int, store: Path) -> None:
    """The daemon's ``status`` (through the CLI) shows every subscriber's checkpoint_done with uri and bytes."""
    note = active_notice(status_cli(sock), notice_id)
    reports = list(note["subscribers"].values())
    assert len(reports) == len(ranks), note
    rec = commit_record(store, step)
    uri = f"{open_storage(str(store)).uri}/step-{step:08d}"
    for r in reports:
        assert r["state"] == "checkpoint_done", note
        assert r["step"] == step and r["uri"] == uri, (r, uri)
        assert r["bytes"] == rec.bytes > 0, (r, rec.bytes)
        assert r["seconds"] >= 0


def drill_when_running(run: TorchRun, sock: str, ranks: set[int], at: int) -> str:
    """Wait until ``ranks`` subscribed to ``sock`` and training passed step ``at``; drill; the notice id."""
    try:
        wait_subscribed(sock, ranks, run)
        run.wait_step(at)
        # 180 s: the notice must still be active when the module's later test restarts the job (the replay);
        # at load 7 that restart subscribed 69-70 s after the drill and a 60 s notice had expired
        return drill(sock, deadline_in=180)
    except BaseException:
        run.kill()
        raise


class _Drilled:
    """One job drilled through one daemon; the daemon stays up (with the notice active) for the module."""

    def __init__(self, tmp: Path, daemon: DaemonProc) -> None:
        self.daemon, self.sock, self.store = daemon, daemon.socket, tmp / "ckpt"
        self.run = TorchRun(tmp / "drilled.log", ["--steps", str(STEPS), "--step-time", STEP_TIME,
                                                  "--storage", str(self.store)], env={"SPOTGUARD_SOCKET": self.sock})
        self.notice_id = drill_when_running(self.run, self.sock, {0, 1}, 3)
        self.rc = self.run.wait(60)


@pytest.fixture(scope="module")
def drilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Drilled]:
    short = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))  # AF_UNIX paths: 107 bytes at most
    tmp = tmp_path_factory.mktemp("drilled")
    try:
        with running_daemon(short / "d.sock", tmp / "daemon.log") as daemon:
            yield _Drilled(tmp, daemon)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_drill_through_real_daemon_commits_reports_and_resumes_bitwise(drilled: _Drilled, reference: Path,
                                                                        tmp_path: Path) -> None:
    run = drilled.run
    assert drilled.rc == 1, run.tail()  # torchrun exits 1 once a worker failed; the worker's 143 is in the log
    stop = assert_agreed_exit(run)
    assert committed(drilled.store) == [stop] and step_folders(drilled.store) == [f"step-{stop:08d}"]
    assert 3 < stop < STEPS
    seen = run.events("notice_seen")
    assert {e["rank"] for e in seen} == {0, 1}, seen  # one node: the daemon told both ranks
    assert all(e["notice_id"] == drilled.notice_id and e["source"] == "drill" and e["via"] == "daemon"
               and e["kind"] == "preemption" for e in seen), seen
    assert {e["notice_id"] for e in run.events("checkpoint_committed")} == {drilled.notice_id}
    assert commit_record(drilled.store, stop).notice_id == drilled.notice_id
    # The hook's checkpoint_started / checkpoint_done reports reached the daemon.
    assert_daemon_saw_done(drilled.sock, drilled.notice_id, {0, 1}, stop, drilled.store)
    # Resume without the daemon (it still holds the notice: see the replay test) and compare.
    resume_to_end(tmp_path, drilled.store, "resumed", stop, reference)


def test_replay_on_same_vm_exits_at_once_without_second_checkpoint(drilled: _Drilled, tmp_path: Path) -> None:
    """The launcher restarts the job on the doomed VM; the daemon replays the notice already checkpointed for."""
    assert drilled.rc == 1
    before = step_folders(drilled.store)
    assert len(before) == 1
    state = query_status(drilled.sock)
    assert drilled.notice_id in {n["id"] for n in state["active_notices"]}, "the notice must still be active"

    run = TorchRun(tmp_path / "replay.log", ["--steps", str(STEPS), "--step-time", STEP_TIME,
                                             "--storage", str(drilled.store)], env={"SPOTGUARD_SOCKET": drilled.sock})
    rc = run.wait(120)
    assert rc == 1, run.tail()
    assert "exitcode  : 143" in run.log.read_text()
    assert run.steps() == [], "the replayed job trained before exiting"
    resumed = {e["rank"]: e for e in run.events("resumed")}
    assert set(resumed) == {0, 1} and all(e["from_notice_id"] == drilled.notice_id for e in resumed.values())
    agreed = {e["rank"]: e for e in run.events("agreed")}
    assert set(agreed) == {0, 1}, run.tail()
    assert all(e["action"] == "exit" and e["notice_id"] == drilled.notice_id for e in agreed.values()), agreed
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 for e in exits.values()), exits
    assert run.events("checkpoint_started") == [] and run.events("checkpoint_committed") == []
    assert step_folders(drilled.store) == before  # exactly one step-* folder: no second checkpoint


def test_notice_to_one_node_only_two_daemons(short_tmp: Path, tmp_path: Path) -> None:
    """Rank 0 listens to daemon A, rank 1 to daemon B ("two nodes"); only B is drilled: both stop together."""
    sock_a, sock_b, store = str(short_tmp / "a.sock"), str(short_tmp / "b.sock"), tmp_path / "ckpt"
    with running_daemon(short_tmp / "a.sock", tmp_path / "daemon-a.log"), \
            running_daemon(short_tmp / "b.sock", tmp_path / "daemon-b.log"):
        run = ScriptRun(tmp_path / "two.log", [*LONG, "--storage", str(store)], script=RANK_SOCKET_LAUNCHER,
                        env={"SG_TEST_SOCKET_RANK0": sock_a, "SG_TEST_SOCKET_RANK1": sock_b})
        try:
            wait_subscribed(sock_a, {0}, run)
            notice_id = drill_when_running(run, sock_b, {1}, 3)
            assert run.wait(60) == 1, run.tail()
        finally:
            run.kill()
        installed = {e["rank"]: e["socket"] for e in run.events("hook_installed")}
        assert installed == {0: sock_a, 1: sock_b}, installed
        stop = assert_agreed_exit(run)
        assert committed(store) == [stop] and len(step_folders(store)) == 1
        seen = run.events("notice_seen")
        assert [e["rank"] for e in seen] == [1] and seen[0]["notice_id"] == notice_id, seen  # only node B heard it
        assert {e["notice_id"] for e in run.events("checkpoint_committed")} == {notice_id}
        assert_daemon_saw_done(sock_b, notice_id, {1}, stop, store)
        assert query_status(sock_a)["active_notices"] == []
        # node B's rank wrote only its own state; node A's wrote the replicated model and optimizer (issue 26)
        writers = commit_record(store, stop).extra["writers"]
        assert writers["doomed"] == [1] and writers["bytes_per_rank"][0] > writers["bytes_per_rank"][1], writers


# The daemon stopped mid-training (SIGINT), a new one on the same socket, the hook re-subscribes and a drill
# through it commits: test_daemon_rollout's rollout test, in the same torchrun job as the rollout.
