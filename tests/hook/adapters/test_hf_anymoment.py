"""HF Trainer's any-moment path (issue 23, ``hf_anymoment.py``): torchrun, 2 ranks (DDP/gloo, CPU), tiny GPT-2.

A notice in the middle of a 4 s training step with a 3 s deadline: the boundary path acts at a step end (the step in
flight and the next: committed ~8 s later, late); the background path commits the last completed step S within a
fraction of a second, in the Trainer's own ``checkpoint-N`` files, equal to the Trainer's own save of S in an
uninterrupted run, and the resumed run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from ._jobs import Job, assert_agreed_exit, committed, read_log, resume_and_compare  # noqa: E402

SCRIPT = "hf_trainer_train.py"
STEPS = 4
AT = 1  # the notice comes in the middle of step 2 (global_step 1 -> 2): S = 1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two loaded checkpoint objects differ (tensors and arrays bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # numpy arrays (the numpy RNG state)
        return [] if a.tobytes() == b.tobytes() and a.dtype == b.dtype else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _trainer_state(path: Path) -> dict[str, Any]:
    st = json.loads(path.read_text())
    st.pop("save_steps")  # the reference run saves every AT steps; the preempted one has no save_steps of its own
    st["stateful_callbacks"]["TrainerControl"]["args"].pop("should_save")  # set while the Trainer's own save runs
    return st


def assert_checkpoint_equals_trainers(ours: Path, theirs: Path) -> None:
    """spotguard's files of step S equal the Trainer's own ``checkpoint-S`` of an uninterrupted run."""
    from safetensors.torch import load_file

    # spotguard's own files beside them (spotguard_fetch_rng_<rank>.pt mid-epoch: hf_fetch.py) are not the Trainer's
    assert sorted(p.name for p in theirs.iterdir()) == sorted(p.name for p in ours.iterdir()
                                                              if p.name != "COMMIT.json" and not p.name.startswith("spotguard_"))
    diffs = _same(load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors")), "model")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        diffs += _same(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False),
                       name)
    diffs += _same(_trainer_state(ours / "trainer_state.json"), _trainer_state(theirs / "trainer_state.json"),
                   "trainer_state")
    assert not diffs, diffs[:10]


def _preempt_mid_step(tmp: Path, *, resume: bool, args: tuple[str, ...] = (), step_time: str = "4") -> None:
    """SIGUSR1 to rank 1 (3 s deadline) 0-1 s into a ``step_time`` step (micro-batch) after step AT: committed for
    S = AT within 1.5 s, not late, its files equal the Trainer's own ``checkpoint-AT`` of an uninterrupted run
    (beside it); ``resume``: the resumed run is bitwise the uninterrupted one."""
    ref_dir = tmp / "ref-out"
    reference = Job(SCRIPT, tmp / "ref.log", ["--steps", str(STEPS), "--no-hook", "--out", str(tmp / "ref.pt"),
                                             "--save-steps", str(AT), "--output-dir", str(ref_dir), *args])
    store = tmp / "ckpt"
    run = Job(SCRIPT, tmp / "preempted.log", ["--steps", str(STEPS), "--step-time", step_time, "--storage",
                                              str(store), *args], env={"SPOTGUARD_SIGNAL_GRACE": "3"})
    try:
        run.wait_step(AT, 90)
        run.signal_rank(1, signal.SIGUSR1)
        assert run.wait(60) != 0
        assert reference.wait(120) == 0, reference.tail()
    finally:
        run.kill()
        reference.kill()
    assert {e["rank"]: e["path"] for e in run.events("notice_path")} == {0: "any-moment", 1: "any-moment"}, \
        run.tail()
    stop = assert_agreed_exit(run)
    assert stop == AT and committed(store) == [AT], run.tail()
    done = run.events("checkpoint_committed")
    assert done and all(e["late"] is False and e["seconds_since_notice"] < 1.5 for e in done), done
    assert not run.events("checkpoint_late"), run.tail()
    staged = run.events("checkpoint_staged")  # an emergency into a local store: written in place, no staging copy
    assert sorted(e["rank"] for e in staged) == [0, 1] and all(e["in_place"] for e in staged), staged
    assert_checkpoint_equals_trainers(store / f"step-{AT:08d}", ref_dir / f"checkpoint-{AT}")
    if resume:
        ref = {int(e["step"]): e["hex"] for e in read_log(tmp / "ref.log").lines() if "hex" in e}
        resume_and_compare(SCRIPT, tmp, (ref, tmp / "ref.pt"), STEPS, AT, args)


def test_notice_mid_step_commits_step_s_from_the_background(tmp_path: Path) -> None:
    """The boundary path committed at the next step's end or later (exit 75: past the 3 s deadline)."""
    _preempt_mid_step(tmp_path, resume=False)


@pytest.mark.long(reason="sibling in make test: test_notice_mid_step_commits_step_s_from_the_background (the same "
                         "notice; its checkpoint equals the Trainer's own save of S file by file)")
def test_notice_mid_step_resumes_bitwise(tmp_path: Path) -> None:
    _preempt_mid_step(tmp_path, resume=True)


@pytest.mark.long(reason="sibling in make test: test_notice_mid_step_commits_step_s_from_the_background and "
                         "test_hf_trainer.py::test_notice_during_accumulation_commits_at_the_next_micro_batch")
def test_notice_mid_micro_batch_with_accumulation_resumes_bitwise(tmp_path: Path) -> None:
    """Gradient accumulation 4, 1.5 s micro-batches: the notice in a micro-batch of step AT+1 commits S = AT
    at once (not at the next micro-batch's end), and the resume replays step AT+1 from its first micro-batch."""
    _preempt_mid_step(tmp_path, resume=True, args=("--grad-accum", "4"), step_time="1.5")


def test_save_pretrained_warm_up_builds_the_conversion_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model made from its config pays transformers' weight-conversion table (~900 regular expressions, 0.8-2.6 s)
    in its first ``save_pretrained``: the warm-up at training start builds it, so a notice's save does not."""
    import structlog
    from transformers import GPT2Config, GPT2LMHeadModel, conversion_mapping

    from spotguard.hook.adapters.hf_anymoment import _warm_save_pretrained

    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)
    cfg = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0)
    _warm_save_pretrained(GPT2LMHeadModel(cfg), structlog.get_logger())
    assert conversion_mapping._checkpoint_conversion_mapping_cache is not None


def test_evaluation_keeps_the_boundary_path_and_says_so(tmp_path: Path) -> None:
    """eval_strategy="steps" is not proven for the background writer: the ``notice_path`` line says boundary and
    why, and no any-moment line is logged (one process, in this one: only the path decision is looked at)."""
    import structlog
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from spotguard import install_preemption_hook
    from spotguard.hook.adapters.hf_anymoment import any_moment_refusal

    cfg = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0)
    data = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 4
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                              eval_strategy="steps", eval_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                              disable_tqdm=True)
    trainer = Trainer(model=GPT2LMHeadModel(cfg), args=targs, train_dataset=data, eval_dataset=data)
    assert "eval_strategy='steps'" in (any_moment_refusal(trainer) or "")
    with structlog.testing.capture_logs() as logs:
        hook = install_preemption_hook(trainer, storage=str(tmp_path / "ckpt"), socket=str(tmp_path / "none.sock"))
        try:
            trainer.train()
        finally:
            hook.close()
    paths = [e for e in logs if e.get("event") == "notice_path"]
    assert paths and all(e["path"] == "boundary" and "eval_strategy='steps'" in e["why"] and
                         "on_step_end" in e["why"] for e in paths), paths


def test_one_process_notice_after_train_returned_is_named_and_commits_nothing(tmp_path: Path) -> None:
    """No torch.distributed (a local round: no collective, no store): a notice in the user's work after
    ``trainer.train()`` returned comes after the run's last optimizer step — training is over, so nothing is
    committed (a checkpoint of max_steps made the restarted Trainer, transformers 5.24, train one step more: review
    hfrev), ``notice_after_last_step`` names it and the job ends with its own code, as on the boundary path (and
    Lightning's any-moment path). Before the review's round: committed step 2, exit 143."""
    import os
    import subprocess
    import sys
    import time

    script = Path(__file__).with_name("hf_one_process_train.py")
    store = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "SPOTGUARD_SOCKET": str(tmp_path / "no-daemon.sock"), "SPOTGUARD_CACHE": str(tmp_path / "cache"),
           "SPOTGUARD_SIGNAL_GRACE": "5", "STEPS": "2", "AFTER": "5", "METER": "1"}
    log = tmp_path / "one.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(script), store], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        end = time.monotonic() + 90
        while '{"trained": 2}' not in log.read_text(errors="replace") and proc.poll() is None and \
                time.monotonic() < end:
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(60)
    finally:
        proc.kill()
    run = read_log(log)
    assert [e["path"] for e in run.events("notice_path")] == ["any-moment"], run.tail()
    assert run.events("checkpoint_committed") == [] and committed(tmp_path / "ckpt") == [], run.tail()
    assert [e["step"] for e in run.events("notice_after_last_step")] == [2], run.tail()
    assert code == 0, (code, run.tail())
