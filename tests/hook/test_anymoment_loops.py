"""Issue 23: a notice is acted on at any moment also in a single process and in ``hook.range()``/``hook.step()``
loops (``_loops_train.py``), not one iteration later at the next boundary.

Each trial: iterations of ``ITER`` seconds from iteration 2 on, a preemption notice with a deadline shorter
than two iterations handed to the hook right after iteration 3's forward. The commit must come within a third
of an iteration of the notice (on main the boundary path committed one iteration later, past the deadline),
the process exits 143 having saved step 3 (the last completed iteration), and the resumed run ends bitwise
where an uninterrupted one does. Synchronisation is the processes' own exit and their JSON log lines.
A loop whose optimizer steps do not map one to one onto iterations (gradient accumulation across
``hook.range`` iterations) stays on the exact boundary path and says so once (``notice_path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from ._torchrun import TorchRun, first_difference, load_out

SCRIPT = Path(__file__).resolve().parent / "_loops_train.py"
STEPS = 7
ITER = 6.0  # seconds per slow iteration
DEADLINE = 8.0  # the notice's: shorter than the rest of iteration 3 plus iteration 4 (the boundary path's commit)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]


class Single(TorchRun):
    """One plain ``python`` process (no torch.distributed), read like a torchrun job."""

    def __init__(self, log: Path, args: list[str], env: Optional[dict[str, str]] = None) -> None:  # noqa: D107
        self.log = log
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "SPOTGUARD_SOCKET": str(log.parent / "no-daemon.sock"), **(env or {})}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), "--single", *args], stdout=f,
                                         stderr=subprocess.STDOUT, env=full_env, cwd=str(log.parent),
                                         start_new_session=True)


def launch(tmp: Path, name: str, single: bool, args: list[str]) -> TorchRun:
    args = ["--steps", str(STEPS), *args]
    if single:
        return Single(tmp / f"{name}.log", args)
    return TorchRun(tmp / f"{name}.log", args, script=SCRIPT)


_REFS: dict[tuple[bool, tuple[str, ...]], Path] = {}


def reference(tmp: Path, single: bool, extra: list[str]) -> Path:
    """The uninterrupted run (no hook; the loop kind does not change it): once per (single, extra) per session,
    in the first caller's folder (pytest keeps the last few sessions' tmp folders)."""
    key = (single, tuple(extra))
    if key in _REFS and _REFS[key].exists():
        return _REFS[key]
    out = tmp / "ref.pt"
    run = launch(tmp, "ref", single, ["--no-hook", "--out", str(out), *extra])
    assert run.wait(120) == 0, run.tail()
    _REFS[key] = out
    return out


def preempted(tmp: Path, single: bool, loop: str, extra: list[str]) -> tuple[TorchRun, Path]:
    store = tmp / "ckpt"
    run = launch(tmp, "preempted", single, ["--loop", loop, "--storage", str(store), "--iter-s", str(ITER),
                                            "--slow-from", "2", "--notice-at", "3", "--notice-rank", "1" if not
                                            single else "0", "--deadline", str(DEADLINE), *extra])
    assert run.wait(120) == 143 if single else run.wait(120) != 0, run.tail()
    return run, store


def resumed_equals(tmp: Path, single: bool, loop: str, store: Path, step: int, ref: Path, extra: list[str]) -> None:
    out = tmp / "resumed.pt"
    run = launch(tmp, "resumed", single, ["--loop", loop, "--storage", str(store), "--out", str(out), *extra])
    assert run.wait(120) == 0, run.tail()
    assert {e["step"] for e in run.events("resumed")} == {step}, run.events("resumed")
    diff = first_difference(load_out(ref), load_out(out))
    assert diff is None, f"resumed run differs from the uninterrupted one at {diff}"


def any_moment(run: TorchRun, ranks: set[int], loop: str) -> None:
    paths = run.events("notice_path")
    assert {e["rank"] for e in paths if e["path"] == "any-moment" and e["loop"] == loop} == ranks, paths
    assert not [e for e in paths if e["path"] == "boundary"], paths


@pytest.mark.parametrize("single,loop", [
    (True, "plain"), (True, "range"),
    pytest.param(True, "step", marks=pytest.mark.long(
        reason="sibling in make test: [single-process-hook-range] (one process acting at any moment inside a "
               "declared loop) and test_gan_commits_mid_iteration[two-ranks-wgan-ncritic-3-hook-step] "
               "(hook.step()'s any-moment path)")),
    pytest.param(False, "range", marks=pytest.mark.long(
        reason="sibling in make test: [single-process-hook-range] (hook.range()'s any-moment path) and "
               "test_gan_commits_mid_iteration[two-ranks-wgan-ncritic-3-hook-step] (two ranks agreeing in the "
               "background inside a declared loop, committed within a fraction of an iteration)")),
], ids=["single-process-own-loop", "single-process-hook-range", "single-process-hook-step", "two-ranks-hook-range"])
def test_long_iterations_commit_within_a_third_of_an_iteration(tmp_path: Path, single: bool, loop: str) -> None:
    ranks = {0} if single else {0, 1}
    ref = reference(tmp_path, single, [])
    run, store = preempted(tmp_path, single, loop, [])
    any_moment(run, ranks, "implicit" if loop == "plain" else f"hook.{loop}()")
    [sent] = [e for e in run.lines() if "notice_sent" in e]
    agreed = run.events("agreed")
    assert {e["rank"] for e in agreed} == ranks and {e["step"] for e in agreed} == {3}, agreed
    assert all(e.get("via") == "background" for e in agreed), agreed
    committed: list[dict[str, Any]] = run.events("checkpoint_committed")
    assert {e["rank"] for e in committed} == ranks and {e["step"] for e in committed} == {3}, committed
    assert max(e["seconds_since_notice"] for e in committed) < ITER / 3, committed
    assert min(e["seconds_left"] for e in committed) > 0, committed
    exits = run.events("exit")
    assert {e["rank"]: (e["code"], e["step"], e["committed"]) for e in exits} == {r: (143, 3, True) for r in ranks}
    # committed before iteration 3 ended (its loss line comes after the slow part)
    ends = [e["t"] for e in run.lines() if e.get("step") == 3 and "loss" in e]
    assert not ends or all(sent["t"] + ITER / 3 < t for t in ends), (sent, ends)
    resumed_equals(tmp_path, single, loop, store, 3, ref, [])


def test_hook_range_with_accumulation_across_iterations_keeps_the_boundary_path(tmp_path: Path) -> None:
    """``opt.step()`` every 2nd iteration of ``hook.range``: the optimizer clock cannot stand for the loop's
    iterations, so the loop says why it acts at boundaries, once, and a notice is acted on there (counted in
    iterations, as before)."""
    store = tmp_path / "ckpt"
    run = launch(tmp_path, "accum", True, ["--loop", "range", "--accum", "2", "--storage", str(store),
                                           "--notice-at", "3", "--deadline", "30"])
    assert run.wait(120) == 143, run.tail()
    paths = [(e["path"], e["loop"]) for e in run.events("notice_path")]
    assert paths == [("any-moment", "hook.range()"), ("boundary", "hook.range()")], paths
    [why] = [e["why"] for e in run.events("notice_path") if e["path"] == "boundary"]
    assert "one to one" in why, why
    [agreed] = run.events("agreed")
    assert agreed.get("via") != "background" and agreed["step"] == 5, agreed
    assert [e["step"] for e in run.events("checkpoint_committed")] == [5]


def test_round_for_a_step_no_boundary_proved_hands_its_notice_to_the_boundary_path(tmp_path: Path) -> None:
    """Iteration 3 of a ``hook.range`` loop steps the optimizer twice and the notice lands between the two
    steps: the round agreed on step 4, which no boundary proves to end an iteration, so it saves nothing
    (``checkpoint_fallback``), the loop leaves the clock at its next boundary and the boundary path commits
    iteration 5; the resumed run ends bitwise where the uninterrupted one does."""
    extra = ["--double-at", "3"]
    ref = reference(tmp_path, True, extra)
    store = tmp_path / "ckpt"
    run = launch(tmp_path, "preempted", True, ["--loop", "range", "--storage", str(store), "--iter-s", "1",
                                              "--notice-at", "3", "--deadline", "30", *extra])
    assert run.wait(120) == 143, run.tail()
    [agreed_bg, agreed] = run.events("agreed")
    assert agreed_bg.get("via") == "background" and agreed_bg["step"] == 4, agreed_bg
    [fallback] = run.events("checkpoint_fallback")
    assert "two optimizer steps" in fallback["reason"], fallback
    assert agreed.get("via") != "background" and agreed["step"] == 5, agreed
    assert [e["step"] for e in run.events("checkpoint_committed")] == [5]
    assert [(e["path"], e["loop"]) for e in run.events("notice_path")] == [("any-moment", "hook.range()"),
                                                                          ("boundary", "hook.range()")]
    resumed_equals(tmp_path, True, "range", store, 5, ref, extra)


GAN_ITER = 3.0  # seconds of the slow discriminator pass (each iteration's own length is a little more)


@pytest.mark.parametrize("single,critic,loop", [
    pytest.param(True, 1, "range", marks=pytest.mark.long(
        reason="sibling in make test: [two-ranks-wgan-ncritic-3-hook-step] (the same two-optimizer boundary "
               "proof and mid-iteration commit) and test_long_iterations_commit_within_a_third_of_an_iteration"
               "[single-process-hook-range] (hook.range() in one process)")),
    (False, 3, "step"),
], ids=["single-process-gan-hook-range", "two-ranks-wgan-ncritic-3-hook-step"])
def test_gan_commits_mid_iteration(tmp_path: Path, single: bool, critic: int, loop: str) -> None:
    """Two optimizers in ``hook.range``/``hook.step()`` (a GAN: D ``critic`` times, then G): the notice lands
    during iteration 3's slow discriminator pass, before any optimizer step of that iteration. The boundaries
    prove each iteration's steps, so the round saves step 3 at once while that iteration goes on (on main: the
    boundary path, one iteration later, past the deadline); the resumed run ends bitwise where the
    uninterrupted one does. ``hook.step()``'s first iteration runs before the loop declares itself (on the
    implicit boundary path, whose flag reduction the first ``hook.step()`` settles on every rank)."""
    _gan_mid_iteration(tmp_path, single, critic, loop, [])


@pytest.mark.parametrize("single,critic,loop", [
    (True, 1, "range"),
    pytest.param(False, 1, "range", marks=pytest.mark.long(
        reason="sibling in make test: [single-process-gan-hook-range] (the copies of D's state taken before its "
               "step, the same code on one rank) and test_gan_commits_mid_iteration[two-ranks-wgan-ncritic-3-"
               "hook-step] (two ranks agreeing in the background in a GAN loop)")),
    pytest.param(False, 3, "step", marks=pytest.mark.long(
        reason="sibling in make test: [single-process-gan-hook-range] (a notice after D's first step; here "
               "between WGAN's critic steps, whose later steps take no new copy)")),
], ids=["single-process-gan-hook-range", "two-ranks-gan-hook-range", "two-ranks-wgan-ncritic-3-hook-step"])
def test_gan_notice_after_the_discriminator_step_commits_the_last_boundary(tmp_path: Path, single: bool,
                                                                            critic: int, loop: str) -> None:
    """Issue 23: the notice lands right after iteration 3's first D step (with WGAN's n_critic = 3: between
    the first and the second critic step), then the slow part. D's parameters and moments of boundary 3 were
    copied before its step (``stepcopy.py``), so the round writes step 3 from the background at once, G's (and
    the next critic's) step held meanwhile (on main: at the iteration's end, step 4, past the deadline); the
    resumed run ends bitwise where the uninterrupted one does."""
    run = _gan_mid_iteration(tmp_path, single, critic, loop, ["--notice-after-d", "1"])
    staged = run.events("checkpoint_staged")
    assert staged and all(e["tensors_from"] == "background" for e in staged), staged


def test_gan_mixed_optimizers_and_a_shared_layer_after_the_discriminator_step(tmp_path: Path) -> None:
    """Review ganrev: a Linear in both D and G (both optimizers step it), D with spectral_norm (its ``_u``/``_v``
    move in G's forward through D) and SGD momentum, its scheduler stepped right after its step, G AdamW with
    amsgrad; the notice right after D's step commits boundary 3 from the copies and the resume is bitwise."""
    _gan_mid_iteration(tmp_path, True, 1, "range", ["--notice-after-d", "1"], ["--mix"])


def test_gan_optimizer_state_created_after_the_boundary_is_left_out(tmp_path: Path) -> None:
    """Review ganrev: a D parameter gets its first gradient (so its AdamW state) in iteration 3; the notice right
    after that D step commits boundary 3, where it had no state, and the resume (a fresh optimizer's template
    has a slot for it) is bitwise."""
    _gan_mid_iteration(tmp_path, True, 1, "range", ["--notice-after-d", "1"], ["--late-head", "3"])


def test_gan_param_group_added_at_the_iteration_top(tmp_path: Path) -> None:
    """Review ganrev: ``opt_d.add_param_group`` at the top of iteration 3 (a layer unfrozen), D's scheduler stepped
    right after its step; the notice right after that D step: what is committed resumes bitwise."""
    _gan_mid_iteration(tmp_path, True, 1, "range", ["--notice-after-d", "1"],
                       ["--late-head", "3", "--add-group", "3", "--mix"])


@pytest.mark.long(reason="sibling in make test: test_gan_mixed_optimizers_and_a_shared_layer_after_the_discriminator_"
                         "step (the same notice after D's step, from the copies, resumed bitwise)")
def test_gan_second_notice_after_a_resume_from_the_copies(tmp_path: Path) -> None:
    """Review ganrev: the run resumed from boundary 3 (written from D's copies) gets its own notice right after
    iteration 5's D step (its first iteration after the resume learns the step pattern again, so the copies are
    back from iteration 4): it commits boundary 5, and a resume from there ends bitwise."""
    run = _gan_mid_iteration(tmp_path, True, 1, "range", ["--notice-after-d", "1"], ["--mix"])
    assert run.events("checkpoint_committed")
    _single_gan_after_d(tmp_path, "again", ["--gan", "1", "--mix"], at=5, deadline=4, committed=5)


@pytest.mark.long(reason="sibling in make test: tests/hook/test_stepcopy.py::test_watch_excuses_only_the_copied_"
                         "parameters (a write no copy holds is seen, in process)")
def test_gan_ema_of_the_discriminator_after_its_step(tmp_path: Path) -> None:
    """Review ganrev: an EMA of D (``AveragedModel`` in the dict, a parameter no copy holds) updated right after
    D's step: the round joining after it cannot stand at the last boundary (documented: a write no copy holds
    sends it to the exact fallback), so it commits the iteration's end, 4, and the resume is bitwise."""
    _single_gan_after_d(tmp_path, "preempted", ["--gan", "1", "--ema-d"], at=3, deadline=30, committed=4)


def _single_gan_after_d(tmp_path: Path, name: str, extra: list[str], *, at: int, deadline: float,
                        committed: int) -> None:
    """One process, ``hook.range``, the notice right after iteration ``at``'s D step (the slow part after it, from
    that iteration on): exits 143 having committed ``committed``, and a resume from there ends bitwise."""
    store = tmp_path / "ckpt"
    run = launch(tmp_path, name, True, ["--loop", "range", "--storage", str(store), "--iter-s", str(GAN_ITER),
                                        "--slow-from", str(at), "--notice-at", str(at), "--notice-after-d", "1",
                                        "--deadline", str(deadline), *extra])
    assert run.wait(120) == 143, run.tail()
    assert [e["step"] for e in run.events("checkpoint_committed")] == [committed], run.tail()
    resumed_equals(tmp_path, True, "range", store, committed, reference(tmp_path, True, extra), extra)


def _gan_mid_iteration(tmp_path: Path, single: bool, critic: int, loop: str, notice: list[str],
                       more: Optional[list[str]] = None) -> TorchRun:
    ranks = {0} if single else {0, 1}
    extra = ["--gan", str(critic), *(more or [])]
    ref = reference(tmp_path, single, extra)
    store = tmp_path / "ckpt"
    run = launch(tmp_path, "preempted", single, ["--loop", loop, "--storage", str(store), "--iter-s",
                                                str(GAN_ITER), "--slow-from", "2", "--notice-at", "3",
                                                "--notice-rank", "0" if single else "1", "--deadline", "4", *extra,
                                                *notice])
    assert run.wait(120) == 143 if single else run.wait(120) != 0, run.tail()
    any_moment(run, ranks, f"hook.{loop}()")
    [sent] = [e for e in run.lines() if "notice_sent" in e]
    agreed = run.events("agreed")
    assert {e["step"] for e in agreed} == {3} and all(e.get("via") == "background" for e in agreed), agreed
    committed = run.events("checkpoint_committed")
    assert {e["rank"] for e in committed} == ranks and {e["step"] for e in committed} == {3}, committed
    assert max(e["seconds_since_notice"] for e in committed) < GAN_ITER / 2, committed
    exits = run.events("exit")
    assert {e["rank"]: (e["code"], e["step"], e["committed"]) for e in exits} == {r: (143, 3, True) for r in ranks}
    ends = [e["t"] for e in run.lines() if e.get("step") == 3 and "loss" in e]
    assert not ends or all(sent["t"] + GAN_ITER / 2 < t for t in ends), (sent, ends)
    resumed_equals(tmp_path, single, loop, store, 3, ref, extra)
    return run


def test_gan_hook_range_with_an_irregular_iteration_goes_back_to_the_boundary_path(tmp_path: Path) -> None:
    """Iteration 3 steps the generator twice: the boundary after it finds other optimizer steps than the first
    iteration's, so the loop leaves the any-moment path there, says why once (``notice_path``), and the
    notice of iteration 4 is acted on at a boundary (not by a background round)."""
    store = tmp_path / "ckpt"
    run = launch(tmp_path, "irregular", True, ["--loop", "range", "--gan", "1", "--double-at", "3", "--storage",
                                               str(store), "--notice-at", "4", "--deadline", "30"])
    assert run.wait(120) == 143, run.tail()
    paths = [(e["path"], e["loop"]) for e in run.events("notice_path")]
    assert paths == [("any-moment", "hook.range()"), ("boundary", "hook.range()")], paths
    [why] = [e["why"] for e in run.events("notice_path") if e["path"] == "boundary"]
    assert "not regular" in why and "'opt_g': 2" in why, why
    [agreed] = run.events("agreed")
    assert agreed.get("via") != "background", agreed
    assert [e["step"] for e in run.events("checkpoint_committed")] == [agreed["step"]]


@pytest.mark.long(reason="sibling in make test: tests/hook/test_stepcopy.py::test_state_created_by_the_first_step_is_"
                         "left_out_and_the_bound_is_kept (the bound refuses the copy, in process)")
@pytest.mark.parametrize("bound", ["1", "0"])
def test_gan_copies_over_the_bound_wait_for_the_iteration_end_and_say_so(tmp_path: Path, bound: str) -> None:
    """``SPOTGUARD_STEP_COPY_MAX_BYTES=1``: D's copy is refused, said once in ``notice_path`` (path
    ``iteration-end``), and a notice after D's step is acted on as before the copies existed: at the iteration's
    end (step 4, exact there), not at the last boundary. ``0`` (the copies off): the same (review ganrev)."""
    store = tmp_path / "ckpt"
    run = Single(tmp_path / "bound.log", ["--steps", str(STEPS), "--loop", "range", "--gan", "1", "--storage",
                                          str(store), "--notice-at", "3", "--notice-after-d", "1", "--deadline", "30"],
                 env={"SPOTGUARD_STEP_COPY_MAX_BYTES": bound})
    assert run.wait(120) == 143, run.tail()
    paths = [(e["path"], e["loop"]) for e in run.events("notice_path")]
    assert paths == [("any-moment", "hook.range()"), ("iteration-end", "hook.range()")], paths
    [why] = [e["why"] for e in run.events("notice_path") if e["path"] == "iteration-end"]
    assert "SPOTGUARD_STEP_COPY_MAX_BYTES" in why and "opt_d" in why, why
    assert [e["step"] for e in run.events("checkpoint_committed")] == [4]
    assert [(e["code"], e["step"], e["committed"]) for e in run.events("exit")] == [(143, 4, True)]
