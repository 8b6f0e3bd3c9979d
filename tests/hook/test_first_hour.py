"""A user's first hour (issue 18), each mistake made in a real ``torchrun`` job (2 ranks, gloo, CPU).

Every test asserts the one clear answer the mistake now gets — at install time where
it can be known then — and that nothing was silently written or claimed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.launch import query_status
from spotguard.storage import open_storage
from spotguard.storage.commit import COMMIT_NAME, CommitRecord, scan, step_dir

from ._daemons import drill, running_daemon, wait_subscribed, wait_until
from ._stores import Store, servers, store  # noqa: F401 - fixtures
from ._torchrun import TorchRun

SCRIPT = Path(__file__).resolve().parent / "_first_hour_train.py"

pytestmark = pytest.mark.timeout(180)


def first(tmp_path: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> TorchRun:
    return TorchRun(tmp_path / f"{name}.log", args, script=SCRIPT, env=env)


def install_errors(run: TorchRun) -> dict[int, str]:
    return {int(e["rank"]): e["install_error"] for e in run.lines() if "install_error" in e}


def committed_steps(uri: str) -> list[int]:
    return [c.step for c in scan(open_storage(uri)) if c.committed]


# -- item 4 ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long(reason="sibling in make test: test_hook_before_init_process_group_is_refused_in_process (its short "
                         "version: the launcher's WORLD_SIZE without a process group refused at install, nothing "
                         "written)")
def test_hook_before_init_process_group_is_refused_under_torchrun(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    run = first(tmp_path, "early", ["--install-before-init", "--storage", str(store)])
    assert run.wait(90) != 0, run.tail()
    errors = install_errors(run)
    assert set(errors) == {0, 1}, run.tail()
    assert all("init_process_group" in e and "WORLD_SIZE=2" in e for e in errors.values()), errors
    assert not any("installed_before_init" in e for e in run.lines())
    assert not store.exists() or committed_steps(str(store)) == []


def test_hook_before_init_process_group_is_refused_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The short version of the torchrun test above: the launcher's environment without a process group."""
    import torch

    from spotguard import install_preemption_hook

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    net = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        install_preemption_hook({"model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)},
                                storage=str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


# -- item 2 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("typo, fix", [("s3:/bucket/run", "s3://bucket/run"), ("gs:/bucket", "gs://bucket"),
                                       ("s3//bucket/run", "s3://bucket/run"), ("gcs://bucket/run", "gs://bucket/run"),
                                       ("file:ckpt", "file://./ckpt"), ("S3:bucket", "s3://bucket")])
def test_storage_uri_typo_is_a_value_error_naming_the_fix(typo: str, fix: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(repr(fix))):
        open_storage(typo)
    assert list(tmp_path.iterdir()) == []  # no local folder was made of it


@pytest.mark.parametrize("ok", ["s3://b/run", "gs://b", "az://c/p", "file:///tmp/x", "file://./x", "./x", "rel/run",
                                "/abs/a:b", "./s3:/b"])
def test_plain_paths_and_known_uris_stay_allowed(ok: str) -> None:
    from spotguard.storage import check_uri

    assert check_uri(ok) == ok


@pytest.mark.slow
@pytest.mark.long(reason="sibling in make test: test_storage_uri_typo_is_a_value_error_naming_the_fix (the same "
                         "check_uri refusal naming the fix, no local folder made of the typo) and "
                         "test_unwritable_local_storage_fails_at_install_not_at_the_emergency (an install failure "
                         "under torchrun reported by both ranks before any step)")
def test_storage_uri_typo_under_torchrun_fails_at_install_and_writes_nothing(tmp_path: Path) -> None:
    run = first(tmp_path, "typo", ["--storage", "s3:/bucket/run"])
    assert run.wait(90) != 0, run.tail()
    errors = install_errors(run)
    assert set(errors) == {0, 1}, run.tail()
    assert all("did you mean 's3://bucket/run'" in e for e in errors.values()), errors
    assert run.steps() == []
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "s3%3A").exists()


# -- item 7 ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_unwritable_local_storage_fails_at_install_not_at_the_emergency(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint folder's parent should be\n")
    run = first(tmp_path, "unwritable", ["--storage", str(blocker / "ckpt")])
    assert run.wait(90) != 0, run.tail()
    errors = install_errors(run)
    assert set(errors) == {0, 1}, run.tail()
    assert all("not writable from rank(s) 0, 1" in e and "StorageError" in e for e in errors.values()), errors
    assert run.steps() == []  # no training that would only find out during a notice


def test_unwritable_storage_fails_at_install_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The short version: one process, a storage path whose parent is a file."""
    import torch

    from spotguard import install_preemption_hook
    from spotguard.storage import StorageError

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "none.sock"))
    (tmp_path / "file").write_text("x")
    net = torch.nn.Linear(2, 1)
    with pytest.raises(StorageError, match="not writable from rank"):
        install_preemption_hook({"model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)},
                                storage=str(tmp_path / "file" / "ckpt"))
    ok = install_preemption_hook({"model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)},
                                 storage=str(tmp_path / "good"))
    try:
        # the probe object was deleted again (history/ is the job's history, spotguard/history)
        assert [o.key for o in ok.storage.list() if not o.key.startswith("history/")] == []
    finally:
        ok.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestUnwritableS3:
    kind = "s3"

    def test_missing_bucket_fails_at_install(self, store: Store, tmp_path: Path) -> None:
        uri = f"s3://{store.bucket}-missing/run"
        run = first(tmp_path, "nobucket", ["--storage", uri], env=store.env)
        assert run.wait(120) != 0, run.tail()
        errors = install_errors(run)
        assert set(errors) == {0, 1}, run.tail()
        assert all("not writable" in e and uri in e for e in errors.values()), errors

    def test_writable_bucket_keeps_no_probe_object(self, store: Store, tmp_path: Path) -> None:
        run = first(tmp_path, "bucket", ["--storage", store.uri, "--steps", "3"], env=store.env)
        assert run.wait(120) == 0, run.tail()
        assert run.steps() == [0, 1, 2]
        keys = [o.key for o in store.open().list()]
        assert [k for k in keys if not k.startswith("history/")] == []  # the probe objects were deleted
        assert keys, "the run's history (hook_installed, resumed, exit) is beside the checkpoints"


# -- item 8 ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_forgotten_resume_warns_and_never_claims_another_runs_checkpoint(tmp_path: Path) -> None:
    store = str(tmp_path / "ckpt")
    one = first(tmp_path, "one", ["--storage", store, "--notify-at", "4"])
    assert one.wait(90) != 0, one.tail()
    exits = {e["rank"]: e for e in one.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), one.tail()
    [step] = committed_steps(store)
    lineage = CommitRecord.from_json((tmp_path / "ckpt" / step_dir(step) / COMMIT_NAME).read_bytes()).extra["lineage"]

    two = first(tmp_path, "two", ["--storage", store, "--notify-at", "4", "--no-resume"])
    assert two.wait(90) != 0, two.tail()
    warned = two.events("not_resumed", 0)
    assert len(warned) == 1 and warned[0]["committed_step"] == step and "hook.resume()" in warned[0]["fix"], two.tail()
    assert two.events("checkpoint_committed") == [], "the second run claimed the first run's checkpoint"
    failed = two.events("checkpoint_failed", 0)
    assert failed and "another run" in failed[0]["error"] and lineage in failed[0]["error"], two.tail()
    exits = {e["rank"]: e for e in two.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 75 and not e["committed"] for e in exits.values()), exits
    record = CommitRecord.from_json((tmp_path / "ckpt" / step_dir(step) / COMMIT_NAME).read_bytes())
    assert record.extra["lineage"] == lineage  # the first run's checkpoint is untouched

    three = first(tmp_path, "three", ["--storage", store])  # with resume: the lineage continues, no warning
    assert three.wait(90) == 0, three.tail()
    assert three.events("not_resumed") == [] and three.steps() == list(range(step, 12))


# -- items 5 and 6: a real daemon -----------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.slow
def test_drill_replayed_to_a_new_job_claims_nothing_and_can_be_cancelled(short_tmp: Path, tmp_path: Path) -> None:
    store = tmp_path / "fresh"
    with running_daemon(short_tmp / "d.sock", tmp_path / "daemon.log") as d:
        nid = drill(d.socket, deadline_in=120)
        run = first(tmp_path, "fresh", ["--storage", str(store), "--steps", "6"], env={"SPOTGUARD_SOCKET": d.socket})
        assert run.wait(90) != 0, run.tail()
        exits = {e["rank"]: e for e in run.events("exit")}
        assert set(exits) == {0, 1}, run.tail()
        # Nothing trained, no checkpoint: nothing to save, and nothing claimed committed.
        assert all(e["code"] == 143 and e["committed"] is False and e["nothing_to_save"] for e in exits.values()), exits
        assert run.events("checkpoint_committed") == [] and committed_steps(str(store)) == []

        out = _cli("drill", "--socket", d.socket, "--cancel", nid)
        assert out.returncode == 0, out.stderr
        assert query_status(d.socket)["active_notices"] == []
        again = _cli("drill", "--socket", d.socket, "--cancel", nid)
        assert again.returncode == 1 and "no active drill" in again.stderr

        ok = first(tmp_path, "after", ["--storage", str(store), "--steps", "6"], env={"SPOTGUARD_SOCKET": d.socket})
        assert ok.wait(90) == 0, ok.tail()
        assert ok.steps() == list(range(6)) and ok.events("exit") == []


@pytest.mark.slow
def test_replayed_rebalance_never_stops_a_restarted_job(short_tmp: Path, tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    with running_daemon(short_tmp / "d.sock", tmp_path / "daemon.log") as d:
        env = {"SPOTGUARD_SOCKET": d.socket}
        one = TorchRun(tmp_path / "one.log", ["--steps", "30", "--step-time", "0.1", "--storage", str(store)], env=env)
        try:
            one.wait_step(3)
            wait_subscribed(d.socket, {0, 1}, one)
            nid = drill(d.socket, kind="rebalance", deadline_in=120)
            one.wait_for(lambda: bool(one.events("checkpoint_committed", 0)), 60, "the rebalance checkpoint")
        except BaseException:
            one.kill()
            raise
        assert one.wait(90) == 0, one.tail()  # a rebalance checkpoint, then training went on
        [step] = committed_steps(str(store))
        assert one.events("checkpoint_committed", 0)[0]["notice_id"] == nid

        # Restarted on the same node while the daemon still replays the rebalance notice.
        two = TorchRun(tmp_path / "two.log", ["--steps", "36", "--storage", str(store)], env=env)
        assert two.wait(90) == 0, two.tail()
        resumed = two.events("resumed", 0)
        assert resumed and resumed[0]["from_notice_id"] == nid and resumed[0]["step"] == step
        assert two.events("exit") == [] and two.steps() == list(range(step, 36))
        ignored = [e for e in two.events("notice_ignored") if e["notice_id"] == nid]
        assert {e["rank"] for e in ignored} == {0, 1}, two.tail()
        wait_until(lambda: any(n["id"] == nid for n in query_status(d.socket)["active_notices"]), 5,
                   "the rebalance notice still active (it was really replayed)")


# -- item 12: credentials per store ---------------------------------------------------------------


def test_gs_without_credentials_is_one_storage_error_naming_the_fix(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9"}  # no metadata server here
    code = ("from spotguard.storage import open_storage, StorageError\n"
            "try:\n    open_storage('gs://bucket/run')\n"
            "except StorageError as exc:\n    print('STORAGE_ERROR', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "STORAGE_ERROR gs:// needs Google credentials" in out.stdout, out.stdout + out.stderr
    assert "GOOGLE_APPLICATION_CREDENTIALS" in out.stdout and "Traceback" not in out.stderr


def test_azure_extra_brings_azure_identity_for_managed_identity() -> None:
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["azure"]
    assert any(r.startswith("azure-identity") for r in extra), extra
