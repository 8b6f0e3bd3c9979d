"""Periodic safety-net checkpoints (``every=``): background upload, commit, resume, and a notice mid-upload."""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from spotguard.hook import Hook, Preempted, events
from spotguard.hook.periodic import PERIODIC_COMMITTED, PERIODIC_FAILED, PERIODIC_SETTLED, PERIODIC_STARTED
from spotguard.notice import Notice
from spotguard.storage.commit import COMMIT_NAME, newest_committed, scan, step_dir
from spotguard.storage.local import LocalStorage
from spotguard.timefmt import utcnow

from ._slowstore import SlowPeriodicStorage
from ._stores import Store, servers, store  # noqa: F401 - fixtures (moto server, bucket, env)
from ._torchrun import TorchRun, first_difference, load_out, reference_run
from .test_boundary import assert_same, boundary_path, make, one_iteration, reference, snapshot

STEP_SLEEP = 0.02


def _hook(state: dict[str, Any], storage: Any, **kw: Any) -> Hook:
    with boundary_path():  # in-process notices: the step-exact boundary path (test_boundary.boundary_path)
        return Hook(state, storage, signals=False, intake=False, **kw)


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def _notice(seconds: float, kind: str = "preemption") -> Notice:
    now = utcnow()
    return Notice(id=f"n-{kind}-{seconds}", source="drill", kind=kind, deadline=now + timedelta(seconds=seconds),
                  received_at=now)


def _resume_and_finish(root: Path, total: int) -> tuple[int, dict[str, Any]]:
    s = make()
    h = _hook(s, LocalStorage(root))
    try:
        start = h.resume()
        for _ in range(start, total):
            one_iteration(s)
    finally:
        h.close()
    return start, snapshot(s)


@pytest.mark.serial
def test_training_keeps_stepping_during_periodic_upload(tmp_path: Path) -> None:
    st = SlowPeriodicStorage(tmp_path, delay_per_item=0.05)  # ~1 s per upload
    s = make()
    h = _hook(s, st, every=0.3)
    steps_at: list[tuple[float, int]] = []
    with structlog.testing.capture_logs() as logs:
        try:
            assert h.resume() == 0
            for _ in range(70):
                one_iteration(s)
                steps_at.append((time.monotonic(), h.iteration))
                time.sleep(STEP_SLEEP)
        finally:
            h.close()  # waits for the upload in flight
    started = _events(logs, PERIODIC_STARTED)
    done = _events(logs, PERIODIC_COMMITTED)
    assert started and done, [e["event"] for e in logs]
    assert not _events(logs, PERIODIC_FAILED)
    first = done[0]
    # Training went on while the first upload was in flight.
    assert first["steps_during"] >= 5, first
    assert started[0]["staging_seconds"] < 0.5 and started[0]["bytes"] > 0
    assert st.slow_writes == len(started)
    committed = [c for c in scan(st) if c.committed]
    assert [c.step for c in committed] == [e["step"] for e in done]
    assert all(c.record is not None and c.record.reason == "periodic" and c.record.notice_id is None
               for c in committed)
    # The newest periodic checkpoint stands for the end of its iteration: resume is bitwise exact.
    start, snap = _resume_and_finish(tmp_path, 75)
    assert start == committed[-1].step
    assert_same(reference(75), snap)


def test_first_periodic_checkpoint_loads_bitwise(tmp_path: Path) -> None:
    """Each committed periodic checkpoint (not only the newest) is a consistent end-of-iteration state."""
    st = SlowPeriodicStorage(tmp_path, delay_per_item=0.02)
    s = make()
    h = _hook(s, st, every=0.2, keep=None)
    try:
        h.resume()
        for _ in range(40):
            one_iteration(s)
            time.sleep(STEP_SLEEP)
    finally:
        h.close()
    committed = [c for c in scan(st) if c.committed]
    assert len(committed) >= 2
    # hide the newer ones: resume must land on the oldest
    for c in committed[1:]:
        st.delete_prefix(c.dir + "/")
    start, snap = _resume_and_finish(tmp_path, 45)
    assert start == committed[0].step
    assert_same(reference(45), snap)


def _run_until_notice_mid_upload(h: Hook, s: dict[str, Any], n: Notice) -> Preempted:
    h.resume()
    notified = False
    for _ in range(400):
        p = h._periodic
        if not notified and p is not None and p.busy and p.job is not None and p.job.done_bytes > 0:
            h.notify(n)
            notified = True
        try:
            one_iteration(s)
        except Preempted as exc:
            return exc
        time.sleep(STEP_SLEEP)
    raise AssertionError("never preempted")


def test_notice_during_upload_finishes_it_when_it_fits(tmp_path: Path) -> None:
    st = SlowPeriodicStorage(tmp_path, delay_per_item=0.04)  # ~1 s upload, 30 s notice: fits in half
    s = make()
    h = _hook(s, st, every=0.3)
    n = _notice(30)
    with structlog.testing.capture_logs() as logs:
        try:
            exc = _run_until_notice_mid_upload(h, s, n)
        finally:
            h.close()
    settled = _events(logs, PERIODIC_SETTLED)
    assert len(settled) == 1 and settled[0]["decision"] == "finish" and settled[0]["committed"], settled
    assert settled[0]["estimate"] is not None and settled[0]["estimate"] <= settled[0]["seconds_left"] / 2
    assert exc.committed and exc.code == 143
    committed = [c for c in scan(st) if c.committed]
    periodic_step = settled[0]["step"]
    assert [(c.step, c.record.reason) for c in committed] == [(periodic_step, "periodic"), (exc.step, "emergency")]
    assert exc.step > periodic_step
    # Order: the periodic commit happened before the emergency checkpoint started.
    names = [e["event"] for e in logs]
    assert names.index(PERIODIC_COMMITTED) < names.index(events.CHECKPOINT_COMMITTED)


@pytest.mark.serial
def test_notice_during_upload_aborts_it_when_too_slow(tmp_path: Path) -> None:
    st = SlowPeriodicStorage(tmp_path, delay_per_item=0.6)  # ~10 s upload, 6 s notice: abort
    s = make()
    h = _hook(s, st, every=0.3)
    n = _notice(6)
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        try:
            exc = _run_until_notice_mid_upload(h, s, n)
        finally:
            h.close()
    assert time.monotonic() - t0 < 8
    settled = _events(logs, PERIODIC_SETTLED)
    assert len(settled) == 1 and settled[0]["decision"] == "abort" and not settled[0]["committed"], settled
    assert settled[0]["waited"] < 1.5  # cancelled at its next item, not waited out
    failed = _events(logs, PERIODIC_FAILED)
    assert len(failed) == 1 and failed[0]["aborted"] is True
    assert exc.committed
    committed = [c for c in scan(st) if c.committed]
    assert [(c.step, c.record.reason) for c in committed] == [(exc.step, "emergency")]
    assert not (tmp_path / step_dir(settled[0]["step"]) / COMMIT_NAME).exists()
    info = newest_committed(st)
    assert info is not None and info.step == exc.step


def test_periodic_argument_validation(tmp_path: Path) -> None:
    s = make()
    with pytest.raises(ValueError):
        _hook(s, str(tmp_path), every=0)
    with pytest.raises(ValueError):
        _hook(s, str(tmp_path), every="15m")  # the Hook takes seconds; install_preemption_hook parses strings


# ------------------------------------------------------------------- 2 ranks, torchrun

PERIODIC_JOB = Path(__file__).resolve().parent / "_periodic_train.py"


STEPS2 = 40


@pytest.fixture(scope="module")
def reference_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run of the example, without spotguard."""
    return reference_run(tmp_path_factory.mktemp("periodic-ref"), STEPS2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_periodic_in_background_then_resume_bitwise(tmp_path: Path, reference_out: Path) -> None:
    steps = STEPS2
    ref_out = reference_out

    store = tmp_path / "store"
    run = TorchRun(tmp_path / "p.log", ["--steps", str(steps), "--storage", str(store), "--every", "0.4",
                                        "--slow", "0.04", "--step-time", "0.05"], script=PERIODIC_JOB)
    assert run.wait() == 0, run.tail()
    done = {r: run.events(PERIODIC_COMMITTED, r) for r in (0, 1)}
    assert done[0] and [e["step"] for e in done[0]] == [e["step"] for e in done[1]], run.tail()
    assert max(e["steps_during"] for e in done[0]) >= 2, done[0]  # training went on during uploads
    committed = [c for c in scan(LocalStorage(store)) if c.committed]
    assert [c.step for c in committed] == [e["step"] for e in done[0]]
    assert all(c.record.reason == "periodic" and c.record.world_size == 2 for c in committed)

    # Resume from the oldest periodic checkpoint (drop the newer ones) and finish: bitwise equal.
    oldest = committed[0]
    for c in committed[1:]:
        LocalStorage(store).delete_prefix(c.dir + "/")
    out = tmp_path / "resumed.pt"
    res = TorchRun(tmp_path / "r.log", ["--steps", str(steps), "--storage", str(store), "--out", str(out)])
    assert res.wait() == 0, res.tail()
    assert {e["rank"]: e["step"] for e in res.events("resumed")} == {0: oldest.step, 1: oldest.step}
    diff = first_difference(load_out(ref_out), load_out(out))
    assert diff is None, f"resumed run differs from the uninterrupted one at {diff}"


# ------------------------------------------------------------------- object store (moto)


def _big_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 8 MiB + momentum
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)}


def _big_step(s: dict[str, Any]) -> None:
    s["optimizer"].zero_grad()
    s["model"](torch.randn(4, 1024)).square().mean().backward()
    s["optimizer"].step()


@pytest.mark.serial  # "waited < 1.0" and the 4 s notice race the 2 s parts: a deadline a neighbour on 2 cores breaks
class TestS3Periodic:
    kind = "s3"

    def test_notice_aborts_slow_periodic_multipart_upload(self, store: Store) -> None:
        """Parts answered after 2 s each: a 4 s notice aborts the periodic upload (no multipart upload left)."""
        # the periodic upload's 4 parts are slow; the emergency checkpoint's parts go through at full speed
        store.proxy.add(method="PUT", path_re=r"partNumber=", delay_after=2.0, count=4)
        s = _big_state()
        h = _hook(s, store.uri, every=0.2)
        n = _notice(4.0)
        with structlog.testing.capture_logs() as logs:
            try:
                h.resume()
                with pytest.raises(Preempted) as info:
                    notified = False
                    for _ in range(300):
                        p = h._periodic
                        if not notified and p is not None and p.busy and time.monotonic() - p.job.started > 0.3:
                            h.notify(n)
                            notified = True
                        _big_step(s)
                        time.sleep(STEP_SLEEP)
            finally:
                h.close()
            # The emergency save did not wait for the abandoned upload: it finishes aborting in the background
            # (its in-flight parts get a 3 s grace, then AbortMultipartUpload).
            assert h._periodic is not None and h._periodic.job is not None
            assert h._periodic.job.finished.wait(15)
        settled = _events(logs, PERIODIC_SETTLED)
        assert len(settled) == 1 and settled[0]["decision"] == "abort", settled
        assert settled[0]["estimate"] is None  # no part had completed yet: unknown, so abort
        assert settled[0]["waited"] < 1.0  # bounded by a quarter of the window, never the upload
        failed = _events(logs, PERIODIC_FAILED)
        assert len(failed) == 1 and failed[0]["aborted"] is True
        assert info.value.committed  # the emergency checkpoint, through its own store instance
        st = store.open()
        assert [(c.step, c.record.reason) for c in scan(st) if c.committed] == [(info.value.step, "emergency")]
        assert st.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_sigterm_during_periodic_upload(tmp_path: Path, reference_out: Path) -> None:
    """Both ranks follow rank 0's decision; the emergency checkpoint commits; resume is bitwise exact."""
    store = tmp_path / "store"
    run = TorchRun(tmp_path / "p.log", ["--steps", str(STEPS2), "--storage", str(store), "--every", "0.5",
                                        "--slow", "0.3", "--step-time", "0.1"], script=PERIODIC_JOB)
    try:
        run.wait_for(lambda: bool(run.events(PERIODIC_STARTED, 1)), 60, "a periodic upload")
        time.sleep(1.0)  # let it make measurable progress
        run.signal_rank(1, signal.SIGTERM)
    except BaseException:
        run.kill()
        raise
    assert run.wait() != 0
    settled = {e["rank"]: e for e in run.events(PERIODIC_SETTLED)}
    assert set(settled) == {0, 1}, run.tail()
    assert settled[0]["decision"] == settled[1]["decision"] and settled[0]["step"] == settled[1]["step"]
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), exits
    agreed = run.events("agreed", 0)[0]["step"]
    reasons = [(c.step, c.record.reason) for c in scan(LocalStorage(store)) if c.committed]
    if settled[0]["decision"] == "finish":
        assert reasons == [(settled[0]["step"], "periodic"), (agreed, "emergency")], reasons
    else:
        assert reasons == [(agreed, "emergency")], reasons

    out = tmp_path / "resumed.pt"
    res = TorchRun(tmp_path / "r.log", ["--steps", str(STEPS2), "--storage", str(store), "--out", str(out)])
    assert res.wait() == 0, res.tail()
    assert {e["rank"]: e["step"] for e in res.events("resumed")} == {0: agreed, 1: agreed}
    diff = first_difference(load_out(reference_out), load_out(out))
    assert diff is None, f"resumed run differs from the uninterrupted one at {diff}"


def test_background_periodic_save_measures_the_write_rate(tmp_path: Path) -> None:
    """A background periodic save measures this rank's write throughput (bytes/s), which a later doomed save's
    ``SPOTGUARD_EVACUATE=auto`` predicts its direct write with. Without it the usual job shape — periodic saves
    in the background, then a notice — always predicted from the assumed 100 MiB/s, never a measured rate."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)  # 2 MiB of weights: a write big enough to measure
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = _hook({"model": model, "optimizer": opt}, LocalStorage(tmp_path), every=0.05)
    with structlog.testing.capture_logs() as logs:
        try:
            h.resume()
            for _ in range(400):
                opt.zero_grad(set_to_none=True)
                model(torch.ones(2, 512)).sum().backward()
                opt.step()
                if _events(logs, PERIODIC_COMMITTED):
                    break
                time.sleep(STEP_SLEEP)
        finally:
            h.close()
    assert _events(logs, PERIODIC_COMMITTED), [e["event"] for e in logs]
    assert h._write_rate is not None and h._write_rate > 0
