"""Issue 23: several optimizers in a loop without ``hook.range()``/``hook.step()`` (``hook.resume()`` and a plain
``for`` loop). The hook learns where an iteration starts: at a step of the first optimizer that stepped (the
clock, a GAN's D) that follows another optimizer's step. WGAN's n_critic > 1 D steps are one iteration: never
counted twice, never a boundary in the middle (on main each D step counted as an iteration and a notice was
acted on at D's second step: a checkpoint of the middle of an iteration, ``hook.resume()`` returning D's steps).
An iteration whose other optimizers step otherwise than in the first one is said once (``iterations_unproven``).
Single processes (``_loops_train.py --single``): the rule is the same under torchrun (the oracle's
``gan_wild_own`` runs it on 2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_anymoment_loops import launch, reference, resumed_equals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _preempted(tmp: Path, extra: list[str], notice_at: int) -> tuple[object, Path]:
    store = tmp / "ckpt"
    run = launch(tmp, "preempted", True, ["--loop", "plain", "--storage", str(store), "--notice-at", str(notice_at),
                                          "--deadline", "30", *extra])
    assert run.wait(120) == 143, run.tail()
    return run, store


def test_wgan_two_critic_steps_per_iteration_commits_the_iterations_end(tmp_path: Path) -> None:
    """D twice then G, a notice before iteration 3's first D step: committed step 4 (iterations 0-3 done, acted
    on at iteration 4's first D step, not at iteration 3's second), exit 143, the resumed run bitwise."""
    extra = ["--gan", "2"]
    ref = reference(tmp_path, True, extra)
    run, store = _preempted(tmp_path, extra, 3)
    paths = run.events("notice_path")
    assert [(e["path"], e["loop"]) for e in paths] == [("boundary", "implicit")], paths
    assert [e["step"] for e in run.events("agreed")] == [4], run.events("agreed")
    assert [e["step"] for e in run.events("checkpoint_committed")] == [4], run.tail()
    [ex] = run.events("exit")
    assert (ex["code"], ex["step"], ex["committed"]) == (143, 4, True), ex
    assert [e["step"] for e in run.lines() if "loss" in e] == [0, 1, 2, 3], "iteration 4 must not have ended"
    assert not run.events("iterations_unproven")
    resumed_equals(tmp_path, True, "plain", store, 4, ref, extra)


def test_an_iteration_with_an_extra_generator_step_is_said_and_still_counted(tmp_path: Path) -> None:
    """Iteration 2 steps G twice (D, G, G): iteration 3 still starts at its D step, so the count holds; the
    other optimizers' steps differ from the first iteration's, which the hook says once (``iterations_unproven``,
    with the fix) — a loop that skips D's step in some iteration would merge two iterations into one."""
    extra = ["--gan", "1", "--double-at", "2"]
    ref = reference(tmp_path, True, extra)
    run, store = _preempted(tmp_path, extra, 4)
    [warned] = run.events("iterations_unproven")
    assert warned["steps"] == {"opt_g": 2} and warned["first"] == {"opt_g": 1}, warned
    assert "hook.range" in warned["fix"], warned
    assert [e["step"] for e in run.events("checkpoint_committed")] == [5], run.tail()
    resumed_equals(tmp_path, True, "plain", store, 5, ref, extra)
