"""The hook on top of the storage layer: failed saves, the notice deadline, object stores end to end."""

from __future__ import annotations

import contextlib
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import structlog
from torch.distributed.checkpoint import FileSystemWriter

from spotguard.hook import Hook, Preempted, events
from spotguard.hook.core import EXIT_SAVE_FAILED, SAVE_MARGIN
from spotguard.notice import Notice
from spotguard.storage.commit import COMMIT_NAME, newest_committed, scan, step_dir
from spotguard.storage.local import LocalStorage
from spotguard.timefmt import utcnow

from ._stores import Store, servers, store  # noqa: F401 - fixtures (moto server, bucket, env)
from ._torchrun import TorchRun, first_difference, load_out, reference_run
from .test_boundary import assert_same, boundary_path, make, notice, one_iteration, reference, snapshot


class FailingWriter(FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("injected: the disk went away")


class FlakyStorage(LocalStorage):
    """A local store whose checkpoint writer fails once ``broken`` is set; records the deadlines it was given."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.broken = False
        self.deadlines: list[float | None] = []

    def dcp_writer(self, key: str, *, thread_count: int | None = None) -> Any:
        if not self.broken:
            return super().dcp_writer(key, thread_count=thread_count)
        self._mkdirs(self._path(key))
        return FailingWriter(str(self._path(key)), single_file_per_rank=True, sync_files=False)

    @contextlib.contextmanager
    def deadline_at(self, deadline: float | None) -> Iterator[None]:
        self.deadlines.append(deadline)
        yield


def _hook(state: dict[str, Any], storage: Any, **kw: Any) -> Hook:
    with boundary_path():  # in-process notices: the step-exact boundary path (test_boundary.boundary_path)
        return Hook(state, storage, signals=False, intake=False, **kw)


def test_failed_save_reports_checkpoint_failed_and_keeps_previous(tmp_path: Path) -> None:
    """DCP raises CheckpointException, a BaseException: the hook must still report and exit cleanly."""
    st = FlakyStorage(tmp_path)
    s = make()
    h = _hook(s, st)
    try:
        h.resume()
        for i in range(3):
            if i == 1:
                h.notify(notice("maintenance"))  # ordinary checkpoint at step 2, keeps training
            one_iteration(s)
        assert [c.step for c in scan(st) if c.committed] == [2]
        st.broken = True
        n = notice()
        with structlog.testing.capture_logs() as logs, pytest.raises(Preempted) as info:
            for i in range(3, 8):
                if i == 4:
                    h.notify(n)
                one_iteration(s)
    finally:
        h.close()
    assert info.value.code == EXIT_SAVE_FAILED == 75 and not info.value.committed and info.value.step == 5
    failed = [e for e in logs if e["event"] == events.CHECKPOINT_FAILED]
    assert len(failed) == 1 and failed[0]["notice_id"] == n.id
    assert "CheckpointException" in failed[0]["error"] and "injected" in failed[0]["error"]
    assert not any(e["event"] == events.CHECKPOINT_COMMITTED for e in logs)
    assert [e for e in logs if e["event"] == events.EXIT][0]["committed"] is False
    assert not (tmp_path / step_dir(5) / COMMIT_NAME).exists()
    info2 = newest_committed(st)
    assert info2 is not None and info2.step == 2

    # The previous checkpoint still loads and resumes exactly.
    s2 = make()
    h2 = _hook(s2, LocalStorage(tmp_path))
    try:
        assert h2.resume() == 2
        for _ in range(2, 6):
            one_iteration(s2)
    finally:
        h2.close()
    assert_same(reference(6), snapshot(s2))


def test_save_is_bounded_by_the_notice_deadline(tmp_path: Path) -> None:
    st = FlakyStorage(tmp_path)
    s = make()
    h = _hook(s, st)
    now = utcnow()
    n = Notice(id="deadline-test", source="drill", kind="preemption", deadline=now + timedelta(seconds=20),
               received_at=now)
    try:
        h.resume()
        with pytest.raises(Preempted) as info:
            h.notify(n)
            for _ in range(3):
                one_iteration(s)
    finally:
        h.close()
    assert info.value.committed
    (bound,) = st.deadlines
    # The bound is the notice deadline (as a monotonic instant) less the teardown margin.
    deadline_mono = time.monotonic() + n.seconds_left()
    assert bound is not None and abs(bound - (deadline_mono - SAVE_MARGIN)) < 0.2


def test_short_notice_keeps_half_the_window(tmp_path: Path) -> None:
    """With less than twice the margin left, the bound is the midpoint, never past the deadline."""
    st = FlakyStorage(tmp_path)
    s = make()
    h = _hook(s, st)
    now = utcnow()
    n = Notice(id="short", source="drill", kind="preemption", deadline=now + timedelta(seconds=1.0), received_at=now)
    try:
        h.resume()
        with pytest.raises(Preempted):
            h.notify(n)
            for _ in range(3):
                one_iteration(s)
    finally:
        h.close()
    (bound,) = st.deadlines
    deadline_mono = time.monotonic() + n.seconds_left()
    assert bound is not None and bound < deadline_mono


# ---------------------------------------------------------------- object store (moto)


class TestS3:
    kind = "s3"

    def test_latest_downloads_committed_checkpoint(self, store: Store, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTGUARD_CACHE", str(tmp_path / "cache"))
        s = make()
        h = _hook(s, store.uri)
        try:
            assert h.resume() == 0 and h.latest() is None
            for i in range(4):
                if i == 2:
                    h.notify(notice("maintenance"))
                one_iteration(s)
            path = h.latest()
        finally:
            h.close()
        assert path is not None
        p = Path(path)
        assert p.is_dir() and p.name == step_dir(3) and str(p).startswith(str(tmp_path / "cache"))
        assert (p / COMMIT_NAME).is_file() and (p / ".metadata").is_file()
        remote = {o.key[len(step_dir(3)) + 1:]: o.size for o in store.open().list(step_dir(3) + "/")}
        local = {f.relative_to(p).as_posix(): f.stat().st_size for f in p.rglob("*") if f.is_file()}
        assert local == remote

    def test_emergency_save_resumes_bitwise_from_s3(self, store: Store) -> None:
        s = make("adam")
        h = _hook(s, store.uri)
        n = notice()
        try:
            h.resume()
            with pytest.raises(Preempted) as info:
                for i in range(10):
                    if i == 5:
                        h.notify(n)
                    one_iteration(s)
        finally:
            h.close()
        assert info.value.committed and info.value.step == 6
        assert store.open().client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
        s2 = make("adam")
        h2 = _hook(s2, store.uri)
        try:
            assert h2.resume() == 6
            for _ in range(6, 10):
                one_iteration(s2)
        finally:
            h2.close()
        assert_same(reference(10, "adam"), snapshot(s2))


STEPS = 30  # test_torchrun's count: the uninterrupted reference run is shared (_torchrun.reference_run)


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestTorchrunS3:
    """2 ranks under torchrun: preempted by a signal, committed to S3 (moto), resumed from S3, bitwise equal."""

    kind = "s3"

    def test_preempt_commit_resume_bitwise(self, store: Store, tmp_path: Path) -> None:
        ref_out = reference_run(tmp_path, STEPS)

        run = TorchRun(tmp_path / "pre.log", ["--steps", str(STEPS), "--step-time", "0.05", "--storage", store.uri])
        try:
            run.wait_step(6)
            run.signal_rank(1, signal.SIGTERM)
        except BaseException:
            run.kill()
            raise
        assert run.wait() != 0
        agreed = {e["rank"]: e["step"] for e in run.events("agreed")}
        assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, run.tail()
        step = agreed[0]
        exits = {e["rank"]: e for e in run.events("exit")}
        assert all(e["code"] == 143 and e["committed"] for e in exits.values()) and set(exits) == {0, 1}, exits
        committed = [c for c in scan(store.open()) if c.committed]
        assert [c.step for c in committed] == [step]
        assert committed[0].record is not None and committed[0].record.world_size == 2
        assert committed[0].record.files  # the shards of both ranks and .metadata, in the bucket

        out = tmp_path / "resumed.pt"
        res = TorchRun(tmp_path / "res.log", ["--steps", str(STEPS), "--storage", store.uri, "--out", str(out)])
        assert res.wait() == 0, res.tail()
        resumed = {e["rank"]: e["step"] for e in res.events("resumed")}
        assert resumed == {0: step, 1: step}, resumed
        assert all(e["uri"].startswith("s3://") for e in res.events("resumed"))
        diff = first_difference(load_out(ref_out), load_out(out))
        assert diff is None, f"resumed run differs from the uninterrupted one at {diff}"
