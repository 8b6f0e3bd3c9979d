"""Issue 23: several optimizers in a loop without ``hook.range()``/``hook.step()`` (``hook.resume()`` and a plain
``for`` loop). The hook learns where an iteration starts: at a step of the first optimizer that stepped (the
clock, a GAN's D) that follows another optimizer's step. WGAN's n_critic > 1 D steps are one iteration: never
counted twice, never a boundary in the middle (on main each D step counted as an iteration and a notice was
acted on at D's second step: a checkpoint of the middle of an iteration, ``hook.resume()`` returning D's steps).
An iteration whose other optimizers step otherwise than in the first one is said once (``iterations_unproven``).
Single processes (``_loops_train.py --single``): the rule is the same under torchrun (the oracle's
``gan_wild_own`` runs it on 2 ranks)."""

from __future__ import annotations

import os
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
    # D twice before G: n_critic or "G every 2nd iteration" look alike to the optimizer hooks: said once, before
    # any commit (the count is right here: the loop is n_critic)
    [warned] = run.events("iterations_unproven")
    assert warned.get("ambiguous") is True and warned["clock_steps"] == 2 and "hook.range" in warned["fix"], warned
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


# --- review (ganrev): loops whose iterations the rule cannot see; each must be exact or warned before the commit
# Cases that held (no defect to keep fixed) run with EXO_MORE=1 only, as the oracle's longer cases: `make test`'s time.
MORE = pytest.mark.skipif(os.environ.get("EXO_MORE", "") != "1", reason="held in review ganrev; EXO_MORE=1 runs it")


def _exact_or_warned(tmp: Path, extra: list[str], notice_at: int, single: bool = True) -> None:
    """The claim: a committed checkpoint is the end of the loop's own iteration ``step`` (= the iterations the loop
    completed before the exit) and the resumed run ends bitwise — or ``iterations_unproven`` came before it (on
    every rank: each rank's log lines are in its own order)."""
    ref = reference(tmp, single, extra)
    if single:
        run, store = _preempted(tmp, extra, notice_at)
    else:
        store = tmp / "ckpt"
        run = launch(tmp, "preempted", False, ["--loop", "plain", "--storage", str(store), "--notice-at",
                                               str(notice_at), "--deadline", "30", *extra])
        assert run.wait(120) != 0, run.tail()
    lines = run.lines()
    done = [e["step"] for e in lines if "loss" in e]  # rank 0 prints them
    ranks = {e["rank"] for e in run.events("checkpoint_committed")}
    assert ranks == ({0} if single else {0, 1}), run.tail()
    told = set()
    for r in ranks:
        mine = [e for e in lines if e.get("component") == "hook" and e.get("rank") == r]
        commits = [k for k, e in enumerate(mine) if e.get("event") == "checkpoint_committed"]
        warned = [k for k, e in enumerate(mine) if e.get("event") == "iterations_unproven"]
        assert len(commits) == 1, run.tail()
        if warned and warned[0] < commits[0]:
            told.add(r)  # said before the commit: the operator was told the count may not be the loop's
    if told:
        assert told == ranks, f"iterations_unproven before the commit on ranks {told} only"
        return
    [step] = {e["step"] for e in run.events("checkpoint_committed")}
    assert step == len(done), f"committed step {step} after {len(done)} completed iterations, no warning before it"
    resumed_equals(tmp, single, "plain", store, step, ref, extra)


@MORE
@pytest.mark.parametrize("extra,notice_at", [(["--gan", "3", "--g-first"], 3), (["--gan", "5"], 2),
                                             (["--gan", "1", "--d-skip", "2"], 1)],
                         ids=["generator-first-n-critic-3", "n-critic-5", "d-skipped-the-commit-at-the-warning"])
def test_held_loops(tmp_path: Path, extra: list[str], notice_at: int) -> None:
    """Held: G before D's 3 steps (G is the clock); n_critic 5; D skipped in iteration 2 with the notice in 1 (the
    commit comes at the very pre-hook whose comparison finds the merged iteration: the warning first)."""
    _exact_or_warned(tmp_path, extra, notice_at)


def test_generator_warm_up_before_the_discriminator_trains(tmp_path: Path) -> None:
    """Iterations 0-1 step G only (a G warm-up), then D, G: G is the clock and its steps in 0-1 look like n_critic
    steps of one iteration; after that every iteration's boundary the hook sees lies between D's and G's step."""
    _exact_or_warned(tmp_path, ["--gan", "1", "--d-skip", "0,1"], 4)


def test_discriminator_skipped_in_the_second_iteration(tmp_path: Path) -> None:
    """D skipped in iteration 1 ("too strong"): the first iteration the hook compares with is the merged one."""
    _exact_or_warned(tmp_path, ["--gan", "1", "--d-skip", "1"], 0)


@pytest.mark.parametrize("single", [True, pytest.param(False, marks=MORE)], ids=["single-process", "two-ranks"])
def test_pytorch_gan_wgan_generator_every_n_critic_batches(tmp_path: Path, single: bool) -> None:
    """PyTorch-GAN's wgan.py: one batch per iteration, D every batch, G when ``i % n_critic == 0``."""
    _exact_or_warned(tmp_path, ["--gan", "1", "--g-every", "3:0", "--steps", "12"], 5, single)


def test_pytorch_gan_generator_every_n_critic_batches_from_the_last(tmp_path: Path) -> None:
    """PyTorch-GAN's wgan.py with G's first step at batch n_critic-1 (i % n == n-1): D, D, D, G steps exactly like
    WGAN's n_critic D steps of one iteration; the hook counts it n_critic times too small — and says so at the end
    of the first "iteration", before the commit (review ganrev: silent before)."""
    _exact_or_warned(tmp_path, ["--gan", "1", "--g-every", "3:2", "--steps", "12"], 5)


@MORE
def test_a_second_notice_after_a_resume_relearns_the_iterations(tmp_path: Path) -> None:
    """WGAN n_critic=3, preempted at iteration 1 (committed 2), resumed and preempted again at iteration 4 (the
    third iteration after the resume): the clock and its pattern are learned anew from the resume's first D step
    (an iteration's start), the second checkpoint is the end of iteration 4, and a third run ends bitwise."""
    extra = ["--gan", "3"]
    ref = reference(tmp_path, True, extra)
    first, store = _preempted(tmp_path, extra, 1)
    assert [e["step"] for e in first.events("checkpoint_committed")] == [2], first.tail()
    second = launch(tmp_path, "preempted-again", True, ["--loop", "plain", "--storage", str(store), "--notice-at",
                                                        "4", "--deadline", "30", *extra])
    assert second.wait(120) == 143, second.tail()
    assert [e["step"] for e in second.events("resumed")] == [2], second.tail()
    assert [e["step"] for e in second.lines() if "loss" in e] == [2, 3, 4], second.tail()
    assert [e["step"] for e in second.events("checkpoint_committed")] == [5], second.tail()
    # relearned, never compared across the resume: only the n_critic ambiguity (said at the first iteration's end)
    said = second.events("iterations_unproven")
    assert [(e.get("ambiguous"), e.get("confirmed")) for e in said] == [(True, None)], said
    resumed_equals(tmp_path, True, "plain", store, 5, ref, extra)


@pytest.mark.xfail(strict=True, reason="the agreement of an implicit GAN loop is launched at the iteration's first D "
                   "step and collected at the next iteration's: a notice after D's first step (during D's second, "
                   "G's step, the post-work) is acted on only at the start of the iteration after next — up to two "
                   "iterations late (gan_wild_own: a notice at iteration 3's end committed step 5; one in iteration "
                   "8 of 10 was never acted on, notice_after_last_step), not 'at the next iteration's first D step' "
                   "as docs/api.md says")
def test_a_notice_at_the_iterations_end_is_acted_on_at_the_next_iterations_start(tmp_path: Path) -> None:
    """WGAN n_critic 2, the notice after iteration 3's G step: the next iteration's first D step commits step 4."""
    run, _ = _preempted(tmp_path, ["--gan", "2", "--notice-late"], 3)
    assert [e["step"] for e in run.events("checkpoint_committed")] == [4], run.events("checkpoint_committed")


@pytest.mark.parametrize("n_critic,once", [
    pytest.param(1, False, marks=pytest.mark.long(reason="the wrappers of [2], one update() per optimizer step; "
                                                  "[2] and [1-one-update] run in make test")),
    (2, False), (1, True)], ids=["1", "2", "1-one-update"])
def test_an_amp_wgan_counts_iterations_not_scaler_updates(tmp_path: Path, n_critic: int, once: bool) -> None:
    """A GradScaler, ``scaler.update()`` after each D and G step (an AMP WGAN must: a second ``scaler.step(opt_d)``
    before ``update()`` raises): the scaler's ``step(opt)``/``update()`` follow the same cycle rule as the optimizer
    hooks, so a notice before iteration 3's first D step commits step 4 (on the old main: each update() counted an
    iteration, committed step 10 after 3 iterations, unsaid), the resumed run bitwise. ``once``: PyTorch's AMP
    recipe for several optimizers, ``scaler.step(opt_d); scaler.step(opt_g); scaler.update()``: the one update()
    closes both steps, D's the iteration's first."""
    extra = ["--gan", str(n_critic), "--scaler", *(["--scaler-once"] if once else [])]
    ref = reference(tmp_path, True, extra)
    run, store = _preempted(tmp_path, extra, 3)
    assert [e["step"] for e in run.events("checkpoint_committed")] == [4], run.tail()
    assert [e["step"] for e in run.lines() if "loss" in e] == [0, 1, 2, 3], run.tail()
    said = run.events("iterations_unproven")  # n_critic 2: the one ambiguity every own-loop n_critic WGAN gets
    assert [e.get("ambiguous") for e in said] == ([True] if n_critic == 2 else []), said
    resumed_equals(tmp_path, True, "plain", store, 4, ref, extra)


