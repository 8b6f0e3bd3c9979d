"""Accelerate's any-moment path (issue 23): a notice in the middle of a long optimizer step is written from the
background for the last completed step, in ``save_state``'s files, and resumed bitwise (torchrun, 2 ranks, gloo)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("accelerate")

from .._stores import Store, servers, store  # noqa: F401 - fixtures (moto server, bucket, env)
from ._jobs import (Job, Reference, assert_agreed_exit, assert_same_losses, first_difference, load_out, losses,
                    preempt_and_resume, read_log, resume_and_compare)

SCRIPT = "accelerate_train.py"
STEPS = 6
LONG_STEP = ("--compute-time", "3")  # every optimizer step lasts > 3 s (slept between backward and step)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _mid_step(tmp_path: Path, deliver: str, marker: str) -> None:
    """A notice right after the first step ended (the next one runs 3 s) with a 3 s deadline: the boundary path acts
    at that step's end (3 s later: late, exit 75); here the round commits step 1 well within it, resumed bitwise."""
    reference = Reference(SCRIPT, tmp_path, STEPS)  # beside the preempted job (ref.log, ref.pt)
    try:
        stop = preempt_and_resume(SCRIPT, tmp_path, reference, STEPS, 0, deliver, marker=marker,
                                  extra_args=LONG_STEP, step_time="0", env={"SPOTGUARD_SIGNAL_GRACE": "3"})
    finally:
        reference.run.kill()
    run = read_log(tmp_path / "preempted.log")
    assert {e["path"] for e in run.events("notice_path")} == {"any-moment"}, run.tail()
    assert all(e["via"] == "background" for e in run.events("agreed")), run.events("agreed")
    committed = run.events("checkpoint_committed")
    assert committed and all(e["seconds_since_notice"] < 1.5 for e in committed), committed
    assert all(e["late"] is False and e["code"] == 143 for e in run.events("exit")), run.events("exit")
    folder = tmp_path / "ckpt" / f"step-{stop:08d}"
    # Accelerate's micro-batch counter as at step `stop` (one accumulate() an optimizer step), not the live one
    for rank in (0, 1):
        assert torch.load(folder / f"random_states_{rank}.pkl", weights_only=False)["step"] == stop
    ref = load_out(tmp_path / "ref.pt")
    diff = first_difference(ref["optimizer"]["state"], load_out(tmp_path / "resumed.pt")["optimizer"]["state"])
    assert diff is None, f"final optimizer state differs at {diff}"


@pytest.mark.serial
def test_notice_mid_step_is_committed_from_the_background_and_resumes_bitwise(tmp_path: Path) -> None:
    _mid_step(tmp_path, "usr1-rank1", "random_states_1.pkl")


@pytest.mark.serial
@pytest.mark.long(reason="sibling in make test: test_notice_mid_step_is_committed_from_the_background_and_resumes_"
                         "bitwise (the same path, SIGUSR1 to rank 1)")
def test_sigterm_to_torchrun_mid_step_resumes_bitwise(tmp_path: Path) -> None:
    _mid_step(tmp_path, "term-torchrun", "model.safetensors")


ACCUM = 4
AT = 2  # S (steps done): the notice comes in the loop's step AT (the (AT+1)-th), two micro-batches after S


@pytest.mark.serial
@pytest.mark.parametrize("ddp", [
    pytest.param((), id="ddp"),
    # each rank's own BatchNorm statistics: save_state writes rank 0's model only, so rank 1 resumed with rank 0's
    pytest.param(("--no-broadcast-buffers",), id="broadcast-buffers-off", marks=pytest.mark.long(
        reason="sibling in make test: [ddp] (the same path; the per-rank buffers file is the only difference)")),
])
def test_notice_mid_micro_batch_with_accumulation_commits_s_and_resumes_bitwise(tmp_path: Path,
                                                                                ddp: tuple[str, ...]) -> None:
    """``gradient_accumulation_steps=4``, 1 s micro-batches: a notice (SIGUSR1 to rank 1, 3 s deadline) in the
    second micro-batch after S = AT completed steps is committed for S from the background within ~1 s — not at the next
    micro-batch (the refused path: p50 2 s) nor at the running step's end (late) — with ``accelerator.step`` = S * 4 and
    the torch RNG at S's first forward; the resume replays the loop's step AT from its first micro-batch, bitwise."""
    args = ("--grad-accum", str(ACCUM), *ddp)
    reference = Reference(SCRIPT, tmp_path, STEPS, args)
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(STEPS), "--step-time", "1", "--storage", str(store),
                                                   *args], env={"SPOTGUARD_SIGNAL_GRACE": "3"})
    try:
        # rank 0 prints a line at each micro-batch's end (then sleeps 1 s): the second of the loop's step AT ended
        run.wait_for(lambda: any(e.get("step") == AT and e.get("micro") == 1 for e in run.lines()), 90,
                     f"micro-batch 1 of step {AT}")
        run.signal_rank(1, signal.SIGUSR1)
        assert run.wait(60) != 0
    finally:
        run.kill()
    try:
        assert {e["path"] for e in run.events("notice_path")} == {"any-moment"}, run.tail()
        assert all(e["via"] == "background" for e in run.events("agreed")), run.events("agreed")
        stop = assert_agreed_exit(run)
        assert stop == AT, run.tail()
        done = run.events("checkpoint_committed")
        assert done and all(e["late"] is False and e["seconds_since_notice"] < 1.5 for e in done), done
        folder = store / f"step-{AT:08d}"
        for rank in (0, 1):  # Accelerate's micro-batch counter of S (it moved on with step AT+1's micro-batches)
            assert torch.load(folder / f"random_states_{rank}.pkl", weights_only=False)["step"] == AT * ACCUM
            assert (folder / f"spotguard_rng_at_forward_{rank}.pt").is_file()
        resume_and_compare(SCRIPT, tmp_path, reference, STEPS, AT, args)
        if ddp:  # rank 1's own buffers (its --out file): bitwise the uninterrupted run's too
            assert (folder / "spotguard_buffers_1.pt").is_file()
            diff = first_difference(load_out(tmp_path / "ref.pt.rank1"), load_out(tmp_path / "resumed.pt.rank1"))
            assert diff is None, f"rank 1's final buffers differ at {diff}"
    finally:
        reference.run.kill()


def test_refusal_names_each_unproven_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configurations not proven exact from the background are refused, each with its reason (milliseconds:
    a stand-in accelerator; the end-to-end refusal is the accumulation test's notice_path check)."""
    from types import SimpleNamespace

    from spotguard.hook.adapters.accelerate_anymoment import any_moment_refusal

    def acc(**kw: object) -> SimpleNamespace:
        base: dict[str, object] = dict(distributed_type=SimpleNamespace(value="MULTI_CPU"),
                                       gradient_accumulation_steps=1, _models=[object()], _optimizers=[object()],
                                       scaler=None, _custom_objects=[], _dataloaders=[],
                                       _save_model_state_pre_hook={})
        return SimpleNamespace(**{**base, **kw})

    monkeypatch.delenv("SPOTGUARD_BACKGROUND_AGREEMENT", raising=False)
    assert any_moment_refusal(acc(), None) is None
    assert any_moment_refusal(acc(gradient_accumulation_steps=4), None) is None  # the background writes S
    cases = {
        "FSDP": acc(distributed_type=SimpleNamespace(value="FSDP")),
        "DEEPSPEED": acc(distributed_type=SimpleNamespace(value="DEEPSPEED")),
        "one prepared model and one optimizer": acc(_optimizers=[object(), object()]),
        "GradScaler": acc(scaler=object()),
        "register_for_checkpointing": acc(_custom_objects=[object()]),
        "stateful": acc(_dataloaders=[SimpleNamespace(use_stateful_dataloader=True)]),
        "pre-hooks": acc(_save_model_state_pre_hook={1: print}),
    }
    for word, a in cases.items():
        why = any_moment_refusal(a, None)
        assert why is not None and word in why, (word, why)
    assert "every=" in (any_moment_refusal(acc(), 900.0) or "")
    monkeypatch.setenv("SPOTGUARD_BACKGROUND_AGREEMENT", "0")
    assert any_moment_refusal(acc(), None) == "SPOTGUARD_BACKGROUND_AGREEMENT=0"


class TestObjectStore:
    """Review of issue 23: the any-moment writer into an object store (moto S3): staged per rank, uploaded from the
    agreement thread, committed, resumed from S3 bitwise."""

    kind = "s3"

    @pytest.mark.long(reason="sibling in make test: test_notice_mid_step_is_committed_from_the_background_and_"
                             "resumes_bitwise (the same path into a folder); S3 staging: test_storage_integration")
    def test_notice_mid_step_into_s3_resumes_bitwise(self, store: Store, tmp_path: Path) -> None:

        from spotguard.storage import open_storage
        from spotguard.storage.commit import scan

        reference = Reference(SCRIPT, tmp_path, STEPS)
        try:
            run = Job(SCRIPT, tmp_path / "preempted.log", ["--steps", str(STEPS), "--step-time", "0", "--storage",
                                                           store.uri, *LONG_STEP], env={"SPOTGUARD_SIGNAL_GRACE": "3"})
            try:
                run.wait_step(0, 90)
                run.signal_rank(1, signal.SIGUSR1)
                assert run.wait(90) != 0
            finally:
                run.kill()
            stop = assert_agreed_exit(run)
            assert {e["path"] for e in run.events("notice_path")} == {"any-moment"}, run.tail()
            assert all(e["via"] == "background" for e in run.events("agreed")), run.events("agreed")
            assert [c.step for c in scan(open_storage(store.uri)) if c.committed] == [stop]
            resumed = Job(SCRIPT, tmp_path / "resumed.log",
                          ["--steps", str(STEPS), "--storage", store.uri, "--out", str(tmp_path / "resumed.pt")])
            assert resumed.wait(120) == 0, resumed.tail()
            assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {0: stop, 1: stop}, resumed.tail()
            ref, ref_out = reference.result()
            assert_same_losses(ref, losses(resumed), stop, STEPS)
            diff = first_difference(load_out(ref_out)["model"], load_out(tmp_path / "resumed.pt")["model"])
            assert diff is None, f"final weights differ at {diff}"
        finally:
            reference.run.kill()


@contextlib.contextmanager
def _auto_named_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """(accelerator with ``automatic_checkpoint_naming``, its hook on the boundary path) in this process, for the
    milliseconds tests of Accelerate's checkpoint numbering; the hook closed and Accelerate's singletons reset."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from spotguard.hook.adapters.accelerate import AccelerateHook

    monkeypatch.setenv("SPOTGUARD_BACKGROUND_AGREEMENT", "0")
    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no-daemon.sock"))
    monkeypatch.setenv("SPOTGUARD_CACHE", str(tmp_path / "cache"))
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "proj"),
                                                                    automatic_checkpoint_naming=True))
    net = torch.nn.Linear(2, 1)
    acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    hook = AccelerateHook(acc, str(tmp_path / "ckpt"))
    try:
        yield acc, hook
    finally:
        hook.close()
        AcceleratorState._reset_state(True)  # in-process singletons: leave none behind
        GradientState._reset_state()


def test_boundary_save_keeps_the_users_automatic_checkpoint_numbering(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of issue 23: ``save_state`` bumps ``project_configuration.iteration`` whatever its folder; the boundary
    path's save (a refused configuration) must not, or after an ordinary notice (training goes on) the user's own
    ``save_state()`` under ``automatic_checkpoint_naming`` writes ``checkpoint_<n+1>`` where the uninterrupted run
    wrote ``checkpoint_<n>`` (and ``total_limit`` prunes by those numbers). One process, milliseconds."""
    with _auto_named_hook(tmp_path, monkeypatch) as (acc, hook):
        hook._write("step-00000001", None)
    assert (tmp_path / "ckpt" / "step-00000001" / "model.safetensors").is_file()
    assert acc.project_configuration.iteration == 0
    assert acc.project_configuration.automatic_checkpoint_naming


def test_resume_restores_the_users_automatic_checkpoint_numbering(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of issue 23 (arev): ``save_state`` does not save ``project_configuration.iteration`` (the user's own
    ``save_state()`` calls so far), so a resumed run numbered its next automatically named checkpoint
    ``checkpoint_0`` again (``ValueError`` "already exists" on a persistent disk; else ``total_limit`` prunes the
    newest). Both writers keep it beside Accelerate's files as of the saved step; the load puts it back. The
    end-to-end case: test_oracle's accelerate-accum-own-auto-named-saves[-boundary]. One process, milliseconds."""
    with _auto_named_hook(tmp_path, monkeypatch) as (acc, hook):
        acc.project_configuration.iteration = 3  # three own checkpoints written before the notice
        hook._write("step-00000001", None)
        acc.project_configuration.iteration = 0  # the resumed process
        hook._realign_at_load(str(tmp_path / "ckpt" / "step-00000001"))
    assert acc.project_configuration.iteration == 3
