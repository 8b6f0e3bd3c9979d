"""DeepSpeedEngine adapter end to end: real deepspeed, torchrun, 2 ranks, gloo, CPU (``DS_ACCELERATOR=cpu``).

The direct engine, ZeRO-2: a notice from a real daemon (drill) while ``every=``
saves periodically; the emergency checkpoint's bytes are then damaged, so the
resume must skip it (quarantine) and resume bitwise from the newest periodic one.
ZeRO-3 with the optimizer offloaded to CPU runs through Accelerate's plugin
(SIGUSR1 to rank 1); the HF Trainer's ``deepspeed=`` path runs ZeRO-2. Each
test's uninterrupted reference runs beside its preempted job (``Reference``).
Refusals (another world size, NVMe offload) are in test_deepspeed_inproc.py.

DeepSpeed JIT-builds its shared-memory comm op at ``init_distributed`` (~2 min on
2 busy cores): ``make deepspeed-tools`` builds it once into
``.venv/torch-extensions``, and every job here uses that folder
(``TORCH_EXTENSIONS_DIR``), so a job starts in seconds; the module checks it was
never rebuilt (a rebuild would cost minutes per job).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")

from spotguard.protocol import DrillCancel  # noqa: E402
from spotguard.daemon.client import request_sync  # noqa: E402
from spotguard.launch import DaemonProc  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.commit import scan  # noqa: E402

from .._daemons import drill, wait_subscribed  # noqa: E402
from ._jobs import Job, Reference, assert_agreed_exit, committed, preempt_and_resume, read_log, resume_and_compare  # noqa: E402, E501

SCRIPT = "deepspeed_train.py"
STEPS = 30

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module", autouse=True)
def ds_env() -> Iterator[None]:
    """CPU accelerator, and the comm op built once (make deepspeed-tools) instead of in every job."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        if not os.environ.get("TORCH_EXTENSIONS_DIR"):
            mp.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
        built = _comm_op_builds()
        yield
        assert _comm_op_builds() == built, "a job rebuilt DeepSpeed's comm op (make deepspeed-tools builds it once)"


def _comm_op_builds() -> dict[str, tuple[int, int]]:
    """The prebuilt comm op's shared objects: (mtime, size) each."""
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*.so")}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_zero2_daemon_notice_every_and_damaged_newest_resumes_bitwise(tmp_path: Path, daemon: DaemonProc) -> None:
    ref = Reference(SCRIPT, tmp_path, STEPS, ("--zero", "2"))  # beside the preempted job
    try:
        _zero2_drill(ref, tmp_path, daemon)
    finally:
        ref.run.kill()


def _zero2_drill(ref: Reference, tmp_path: Path, daemon: DaemonProc) -> None:
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log",
              ["--zero", "2", "--steps", str(STEPS), "--step-time", "0.2", "--storage", str(store), "--every", "1"],
              env={"SPOTGUARD_SOCKET": daemon.socket})
    try:
        wait_subscribed(daemon.socket, {0, 1}, run)
        # two periodic commits: the notice's step may be the newest of them (the any-moment path saves the last
        # completed step, already committed when the notice follows a periodic save), with an older one left
        run.wait_for(lambda: len({e.get("notice_id") for e in run.events("checkpoint_committed")
                                  if str(e.get("notice_id")).startswith("periodic-")}) >= 2, 120,
                     "two periodic checkpoints committed")
        notice_id = drill(daemon.socket, deadline_in=20.0)
        assert run.wait(90) != 0
    finally:
        run.kill()
    request_sync(daemon.socket, DrillCancel(id=notice_id))  # the restarted job must not get it replayed
    agreed = {e["rank"]: e["step"] for e in run.events("agreed") if e.get("notice_id") == notice_id}
    assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, (agreed, run.tail())
    stop = agreed[0]
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] and e["notice_id"] == notice_id
                                        for e in exits.values()), exits
    steps = committed(store)
    assert stop in steps and len(steps) >= 2 and stop == steps[-1], steps
    folder = store / f"step-{stop:08d}"
    names = sorted(p.name for p in folder.iterdir())
    for want in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt", "spotguard_rank0.pt", "spotguard_rank1.pt"):
        assert want in names, names
    record = json.loads((folder / "COMMIT.json").read_text())
    already = any(e.get("already_committed") for e in run.events("checkpoint_committed")
                  if e.get("notice_id") == notice_id)  # the notice's step was a periodic save's: not written twice
    assert record["world_size"] == 2 and record["reason"] == ("periodic" if already else "emergency"), record

    # The emergency checkpoint is damaged after its commit: the resume quarantines it and takes the one before.
    _flip_byte(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    good = steps[-2]
    resume_and_compare(SCRIPT, tmp_path, ref, STEPS, good, ("--zero", "2"))
    infos = {i.step: i for i in scan(open_storage(str(store)))}
    assert infos[stop].quarantine is not None, infos[stop]


def _plugin_job(package: str, script: str, steps: int, at: int, deliver: str, marker: str, stage: str,
                tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, *extra: str) -> Path:
    """A framework's DeepSpeed path (``--deepspeed STAGE``): reference, preempted, resumed bitwise; the step folder."""
    pytest.importorskip(package)
    args = ("--deepspeed", stage, *extra)
    ref = Reference(script, tmp_path_factory.mktemp(f"{package}-ds-ref"), steps, args)  # beside the preempted job
    try:
        stop = preempt_and_resume(script, tmp_path, ref, steps, at, deliver, marker=marker, extra_args=args)
    finally:
        ref.run.kill()
    return tmp_path / "ckpt" / f"step-{stop:08d}"


def test_accelerate_zero3_offload_gathered_usr1_resumes_bitwise(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """ZeRO-3, optimizer offloaded to CPU, ``stage3_gather_16bit_weights_on_model_save`` (the save gathers the
    weights too), through Accelerate's DeepSpeedPlugin: ``install_preemption_hook(accelerator)`` is the DeepSpeed
    adapter on the prepared engine (the Accelerate adapter's optimizer hooks never fire there: DeepSpeed steps its
    own optimizer). (Its refusal on another world size: test_deepspeed_inproc.py.)"""
    folder = _plugin_job("accelerate", "accelerate_train.py", 10, 4, "usr1-rank1",
                         "zero_pp_rank_1_mp_rank_00_model_states.pt", "3", tmp_path_factory, tmp_path, "--offload")
    run = read_log(tmp_path / "preempted.log")
    assert {e["rank"] for e in run.events("deepspeed_installed")} == {0, 1}, run.tail()
    assert {e["zero_stage"] for e in run.events("deepspeed_installed")} == {3}, run.tail()
    names = {p.name for p in folder.iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} | {"spotguard_rank1.pt"} <= names, names
    assert json.loads((folder / "COMMIT.json").read_text())["world_size"] == 2


def test_hf_trainer_deepspeed_config_sigterm_to_rank1_resumes_bitwise(tmp_path_factory: pytest.TempPathFactory,
                                                                      tmp_path: Path) -> None:
    """``TrainingArguments(deepspeed=...)``: the Trainer writes its checkpoint with the engine; every rank's ZeRO
    partition file is part of the commit (each rank uploads its own), and the Trainer's resume loads them."""
    folder = _plugin_job("transformers", "hf_trainer_train.py", 12, 4, "term-rank1", "rng_state_1.pth", "2",
                         tmp_path_factory, tmp_path)
    step = int(folder.name.split("-")[1])
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*.pt")}
    assert {f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= names, names


@pytest.mark.serial
@pytest.mark.parametrize("zero", [pytest.param("2", marks=pytest.mark.long(
    reason="sibling in make test: [3] (the same any-moment adapter path and timing: agreed and written in the "
           "background during a 3 s backward, committed within 1.5 s, DeepSpeed's load_checkpoint bitwise; ZeRO-3 "
           "adds only the placeholder branch of _ds_module_state), tests/exactness/test_oracle.py"
           "[deepspeed-zero2-notice-in-backward] (ZeRO-2, a notice in a backward, any-moment, resumed exact on both "
           "ranks) and test_deepspeed_ema.py[any-moment] (ZeRO-2 any-moment, resumed bitwise)")), "3"])
def test_notice_mid_backward_commits_before_the_step_ends_and_resumes_bitwise(tmp_path: Path, zero: str) -> None:
    """The any-moment path (issue 29's performance part): a notice 3 s before the engine's next step (its backward
    sleeps 3 s) is agreed and written in the background, for the step completed before it, while the backward
    goes on — committed well before the step in flight ends (the boundary path waited for that step: ~3 s, and
    saved the step after). The resume from it (DeepSpeed's own load_checkpoint) is bitwise."""
    import signal

    steps = 8
    ref = Reference(SCRIPT, tmp_path, steps, ("--zero", zero))  # beside the preempted job
    try:
        store = tmp_path / "ckpt"
        run = Job(SCRIPT, tmp_path / "preempted.log",
                  ["--zero", zero, "--steps", str(steps), "--backward-time", "3", "--storage", str(store)])
        try:
            run.wait_step(1, 120)  # step 1 printed: iteration 2's 3 s backward is running
            run.signal_rank(1, signal.SIGUSR1)
            assert run.wait(90) != 0
        finally:
            run.kill()
        paths = {e["rank"]: e["path"] for e in run.events("notice_path")}
        assert paths == {0: "any-moment", 1: "any-moment"}, run.tail()
        stop = assert_agreed_exit(run)
        assert stop == 2, (stop, run.tail())  # engine steps completed when the notice came (steps 0 and 1)
        took = [e["seconds_since_notice"] for e in run.events("checkpoint_committed")]
        assert len(took) == 2 and max(took) < 1.5, took  # the backward in flight had ~3 s left
        resume_and_compare(SCRIPT, tmp_path, ref, steps, stop, ("--zero", zero))
    finally:
        ref.run.kill()
