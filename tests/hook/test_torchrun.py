"""End to end with real ``torchrun`` (2 ranks, gloo, CPU): preempt, commit, exit 143, resume bitwise."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from spotguard.storage import open_storage
from spotguard.storage.commit import COMMIT_NAME, scan, step_dir

from ._torchrun import TorchRun, first_difference, load_out, reference_run

STEPS = 30
STEP_TIME = "0.05"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.serial]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, same code path without spotguard."""
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def committed(store: Path) -> list[int]:
    return [c.step for c in scan(open_storage(str(store))) if c.committed]


def preempt(tmp: Path, store: Path, name: str, at: int, rank: int, sig: int,
            env: dict[str, str] | None = None) -> TorchRun:
    run = TorchRun(tmp / f"{name}.log", ["--steps", str(STEPS), "--step-time", STEP_TIME, "--storage", str(store)],
                   env=env)
    try:
        run.wait_step(at)
        run.signal_rank(rank, sig)
    except BaseException:
        run.kill()
        raise
    return run


def assert_agreed_exit(run: TorchRun, launcher_summary: bool = True) -> int:
    """Both ranks agreed on one step, committed, and exited 143; returns the step."""
    agreed = {e["rank"]: e["step"] for e in run.events("agreed")}
    assert set(agreed) == {0, 1}, run.tail()
    assert len(set(agreed.values())) == 1, f"ranks stopped at different steps: {agreed}"
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), exits
    notice_ids = {e["notice_id"] for e in run.events("checkpoint_committed")}
    assert len(notice_ids) == 1, notice_ids  # every rank names the same notice, wherever it arrived
    if launcher_summary:  # torchrun's failure summary (absent when torchrun itself was signalled)
        assert "exitcode  : 143" in run.log.read_text()
    return next(iter(agreed.values()))


def resume_to_end(tmp: Path, store: Path, name: str, expect_step: int, reference: Path) -> None:
    out = tmp / f"{name}.pt"
    run = TorchRun(tmp / f"{name}.log", ["--steps", str(STEPS), "--storage", str(store), "--out", str(out)])
    assert run.wait() == 0, run.tail()
    resumed = {e["rank"]: e["step"] for e in run.events("resumed")}
    assert resumed == {0: expect_step, 1: expect_step}, resumed
    assert run.steps()[0] == expect_step
    diff = first_difference(load_out(reference), load_out(out))
    assert diff is None, f"resumed run differs from the uninterrupted one at {diff}"


# (seed, rank, signal, SPOTGUARD_SIGNAL_GRACE): the notice to one rank only, three ways
PREEMPTIONS = [(11, 1, signal.SIGUSR1, None), (12, 0, signal.SIGTERM, None), (13, 1, signal.SIGTERM, 15)]


def test_preemptions_at_random_steps_chained_each_resume_exact(reference: Path, tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 only, SIGTERM to rank 0 only, SIGTERM to rank 1 only: one after another on one store,
    each job resuming where the last one committed (both ranks at that step) and preempted a few steps later; the
    last resume runs to the end, bitwise the uninterrupted run (a resume off at any link would show there). One
    torchrun job a case instead of two (a preempted job and a resume to the end each). ``grace``:
    ``SPOTGUARD_SIGNAL_GRACE`` (GKE 15 s, torchrun 30 s), the deadline a SIGTERM gets; checked in this job (it had
    one of its own in test_daemon_rollout)."""
    store = tmp_path / "ckpt"
    stops: list[int] = []
    for k, (seed, rank, sig, grace) in enumerate(PREEMPTIONS):
        start = stops[-1] if stops else 0
        at = start + random.Random(seed).randint(2, 6)
        run = preempt(tmp_path, store, f"preempted-{k}", at, rank, sig,
                      env={"SPOTGUARD_SIGNAL_GRACE": str(grace)} if grace else None)
        assert run.wait() != 0  # torchrun itself exits 1 once a worker failed
        if stops:
            resumed = {e["rank"]: e["step"] for e in run.events("resumed")}
            assert resumed == {0: start, 1: start}, resumed
            assert run.steps()[0] == start
        stop = assert_agreed_exit(run)
        if grace:
            seen = [e for e in run.events("notice_seen") if e["via"] == "signal"]
            assert seen and all(grace - 5 < e["seconds_left"] <= grace for e in seen), seen
        assert at < stop <= STEPS
        stops.append(stop)
        assert committed(store) == stops
    resume_to_end(tmp_path, store, "resumed", stops[-1], reference)


def test_sigterm_to_torchrun_without_daemon(reference: Path, tmp_path: Path) -> None:
    """Kubernetes/SLURM style: SIGTERM to the launcher, which forwards it to every worker."""
    store = tmp_path / "ckpt"
    run = TorchRun(tmp_path / "term.log", ["--steps", str(STEPS), "--step-time", STEP_TIME, "--storage", str(store)])
    run.wait_step(5)
    run.proc.send_signal(signal.SIGTERM)
    run.wait()
    stop = assert_agreed_exit(run, launcher_summary=False)
    assert committed(store) == [stop]
    assert all(e["source"] == "signal" for e in run.events("notice_seen"))
    resume_to_end(tmp_path, store, "resumed", stop, reference)


def test_rank_sigkilled_during_save(reference: Path, tmp_path: Path) -> None:
    """No commit record; the survivor fails the save and exits in bounded time; resume uses the older one."""
    store = tmp_path / "ckpt"
    first = preempt(tmp_path, store, "first", 3, 0, signal.SIGUSR1)
    first.wait()
    k1 = assert_agreed_exit(first)

    # Rank 1 lingers 30 s after writing its shards: the kill lands inside the save.
    run = TorchRun(tmp_path / "second.log", ["--steps", str(STEPS), "--step-time", STEP_TIME, "--storage", str(store)],
                   env={"SPOTGUARD_TEST_SAVE_DELAY": "30", "SPOTGUARD_TEST_SAVE_DELAY_RANK": "1"})
    try:
        run.wait_step(k1 + 3)
        run.signal_rank(0, signal.SIGUSR1)
        run.wait_for(lambda: bool(run.events("checkpoint_started", 1)), 30, "rank 1 checkpoint_started")
        k2 = run.events("checkpoint_started", 1)[0]["step"]
        time.sleep(0.5)  # rank 1's shards are written; it now sits in the test delay
        killed_at = time.monotonic()
        run.signal_rank(1, signal.SIGKILL)
        run.wait_for(lambda: bool(run.events("exit", 0)), 25, "the survivor's exit")
        survivor_seconds = time.monotonic() - killed_at
        assert run.wait(40) != 0
    finally:
        run.kill()
    assert survivor_seconds < 15, survivor_seconds
    failed = run.events("checkpoint_failed", 0)
    assert failed, run.tail()
    exit0 = run.events("exit", 0)[0]
    assert exit0["code"] == 75 and exit0["committed"] is False  # a failed save exits 75, not 143
    assert not (store / step_dir(k2) / COMMIT_NAME).exists()
    assert committed(store) == [k1]
    resume_to_end(tmp_path, store, "resumed", k1, reference)
