"""Drive an ``examples/*_train.py`` under ``torchrun`` (2 ranks, gloo, CPU) and check a preemption end to end.

Reuses ``tests/hook/_torchrun.TorchRun`` (log parsing, rank pids, waiting) with
another script. Each example prints one JSON line per step on rank 0:
``{"step": k, "loss": float, "hex": float.hex()}`` and takes ``--steps``,
``--storage``, ``--step-time``, ``--out``, ``--no-hook``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional

from spotguard.storage import open_storage
from spotguard.storage.commit import scan

from .._torchrun import REPO, TORCHRUN, TorchRun, first_difference, job_tmpdir, load_out

__all__ = ["Job", "drill_beside_reference", "Reference", "read_log", "preempt_in_accumulation", "resume_and_compare", "ACCUM_STEPS", "ACCUM_ARGS", "losses", "committed", "assert_agreed_exit", "assert_same_losses", "first_difference", "load_out"]

HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"}


class Job(TorchRun):
    """``torchrun --standalone --nproc-per-node N examples/<script> ARGS`` with its log in ``log``."""

    def __init__(self, script: str, log: Path, args: list[str], *, nproc: int = 2,
                 env: Optional[dict[str, str]] = None) -> None:
        self.log = log
        # the examples' own temp folders (the HF Trainer's default output_dir, /tmp/hf-out-*, one a rank) go
        # under the test's folder, not /tmp, where they were left behind
        tmpdir = job_tmpdir(log)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **HUB_OFFLINE,
                    "SPOTGUARD_SOCKET": str(log.parent / "no-daemon.sock"),
                    "SPOTGUARD_CACHE": str(log.parent / "cache"), "TMPDIR": str(tmpdir), **(env or {})}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(REPO / "examples" / script), *args],
                stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=str(log.parent), start_new_session=True,
            )


def read_log(log: Path) -> TorchRun:
    """A finished job's log, read with ``TorchRun``'s parsers (nothing is started)."""
    run = TorchRun.__new__(TorchRun)
    run.log = log
    return run


def losses(job: TorchRun) -> dict[int, str]:
    """Step -> loss as ``float.hex`` (exact), from rank 0's lines."""
    return {int(e["step"]): e["hex"] for e in job.lines() if "hex" in e and "step" in e}


def committed(store: Path) -> list[int]:
    return [c.step for c in scan(open_storage(str(store))) if c.committed]


def assert_agreed_exit(run: TorchRun, ranks: tuple[int, ...] = (0, 1)) -> int:
    """Every rank agreed on one step, committed it and exited 143; returns the step."""
    agreed = {e["rank"]: e["step"] for e in run.events("agreed")}
    assert set(agreed) == set(ranks), run.tail()
    assert len(set(agreed.values())) == 1, f"ranks stopped at different steps: {agreed}"
    exits = {e["rank"]: e for e in run.events("exit")}
    assert set(exits) == set(ranks) and all(e["code"] == 143 and e["committed"] for e in exits.values()), exits
    assert len({e["notice_id"] for e in run.events("checkpoint_committed")}) == 1
    assert "exitcode  : 143" in run.log.read_text(), run.tail()
    return next(iter(agreed.values()))


def assert_same_losses(reference: dict[int, str], resumed: dict[int, str], start: int, total: int) -> None:
    """The resumed run's steps start..total-1 have bitwise the losses of the uninterrupted run."""
    assert sorted(resumed) == list(range(start, total)), sorted(resumed)
    diff = [(k, reference[k], resumed[k]) for k in resumed if reference.get(k) != resumed[k]]
    assert not diff, f"resumed losses differ from the uninterrupted run (step, ref, resumed): {diff[:5]}"


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                out.append(json.loads(raw))
            except ValueError:
                pass
    return out


def preempt_and_resume(script: str, tmp: Path, reference: "tuple[dict[int, str], Path] | Reference", steps: int,
                       at: int,
                       deliver: str, *, marker: str, resume_args: tuple[str, ...] = (),
                       extra_args: tuple[str, ...] = (), step_time: str = "0.05",
                       env: Optional[dict[str, str]] = None) -> int:
    """Preempt a run at ``at`` (``usr1-rank1``, ``term-rank0``, ``term-rank1`` or ``term-torchrun``), check the
    agreed exit and the commit, resume to the end and compare losses and final weights bitwise; returns the step."""
    import signal

    store = tmp / "ckpt"
    run = Job(script, tmp / "preempted.log",
              ["--steps", str(steps), "--step-time", step_time, "--storage", str(store), *extra_args], env=env)
    try:
        run.wait_step(at, 90)
        if deliver == "term-torchrun":  # torchrun forwards it to every worker (Kubernetes / SLURM style)
            run.pid(0), run.pid(1)
            run.proc.send_signal(signal.SIGTERM)
        else:
            kind, _, who = deliver.partition("-")
            run.signal_rank(int(who[-1]), signal.SIGUSR1 if kind == "usr1" else signal.SIGTERM)
        assert run.wait(90) != 0
    finally:
        run.kill()
    if deliver == "term-torchrun":  # torchrun's own summary is absent when it was signalled itself
        agreed = {e["rank"]: e["step"] for e in run.events("agreed")}
        assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, run.tail()
        stop = agreed[0]
        assert all(e["code"] == 143 and e["committed"] for e in run.events("exit")), run.tail()
    else:
        stop = assert_agreed_exit(run)
    assert at <= stop < steps, (at, stop)
    assert committed(store) == [stop]
    assert (store / f"step-{stop:08d}" / marker).is_file(), sorted(p.name for p in (store / f"step-{stop:08d}").iterdir())

    resume_and_compare(script, tmp, reference, steps, stop, (*extra_args, *resume_args))
    return stop


def resume_and_compare(script: str, tmp: Path, reference: "tuple[dict[int, str], Path] | Reference", steps: int,
                       start: int,
                       args: tuple[str, ...] = ()) -> None:
    """Run ``script`` on ``tmp/ckpt`` to the end: both ranks resume at ``start``, and the losses of steps
    start..steps-1 and the final weights equal the uninterrupted run's bitwise."""
    if isinstance(reference, Reference):
        reference = reference.result()
    resumed = Job(script, tmp / "resumed.log",
                  ["--steps", str(steps), "--storage", str(tmp / "ckpt"), "--out", str(tmp / "resumed.pt"), *args])
    assert resumed.wait(120) == 0, resumed.tail()
    assert {e["rank"]: e["step"] for e in resumed.events("resumed")} == {0: start, 1: start}, resumed.tail()
    ref, ref_out = reference
    assert_same_losses(ref, losses(resumed), start, steps)
    diff = first_difference(load_out(ref_out)["model"], load_out(tmp / "resumed.pt")["model"])
    assert diff is None, f"final weights differ at {diff}"


# Issue 23: 8 micro-batches a step (12 an epoch a rank in both examples' data), 0.75 s each, a 4 s notice
ACCUM_STEPS = 6
ACCUM_ARGS = ("--grad-accum", "8")


def preempt_in_accumulation(script: str, tmp: Path, marker: str, env: Optional[dict[str, str]] = None) -> None:
    """A notice (SIGUSR1 to rank 1, 4 s deadline) at the first micro-batch of step 2: acting at the step's end
    would commit ~5 s later, late (exit 75). Acted on at the next micro-batch, the checkpoint of step 2 commits in
    time (143, no ``checkpoint_late``) and the resume replays step 2 from its first micro-batch, bitwise. The
    uninterrupted run goes beside the preempted job (it sleeps 6 s a step before the notice)."""
    reference = Reference(script, tmp, ACCUM_STEPS, ACCUM_ARGS)  # ref.log, ref.pt
    try:
        stop = preempt_and_resume(script, tmp, reference, ACCUM_STEPS, 2, "usr1-rank1", marker=marker,
                                  extra_args=ACCUM_ARGS, step_time="0.75", env={"SPOTGUARD_SIGNAL_GRACE": "4", **(env or {})})
    finally:
        reference.run.kill()
    assert stop == 2
    run = read_log(tmp / "preempted.log")
    assert not run.events("checkpoint_late"), run.tail()
    assert all(e["late"] is False for e in run.events("exit")), run.events("exit")


def reference_run(script: str, d: Path, steps: int, extra_args: tuple[str, ...] = ()) -> tuple[dict[int, str], Path]:
    return Reference(script, d, steps, extra_args).result()


class Reference:
    """The uninterrupted run, started now and read when the resume is compared: started beside the preempted
    job (which mostly sleeps between its steps), it costs no wall time of its own."""

    def __init__(self, script: str, d: Path, steps: int, extra_args: tuple[str, ...] = ()) -> None:
        self.steps, self.out = steps, d / "ref.pt"
        self.run = Job(script, d / "ref.log", ["--steps", str(steps), "--no-hook", "--out", str(self.out), *extra_args])
        self._result: Optional[tuple[dict[int, str], Path]] = None

    def result(self) -> tuple[dict[int, str], Path]:
        if self._result is None:
            try:
                assert self.run.wait(120) == 0, self.run.tail()
            finally:
                self.run.kill()
            ref = losses(self.run)
            assert sorted(ref) == list(range(self.steps)), self.run.tail()
            self._result = (ref, self.out)
        return self._result


def drill_beside_reference(ref: Job, run: Job, socket: str, fired: Callable[[], bool], deadline: float,
                           drill: Callable[..., str]) -> str:
    """Drill ``run`` once ``fired()`` (both ranks subscribed to the daemon at ``socket``), wait for it and for the
    uninterrupted ``ref`` that runs beside it (no sleeps: it costs no wall time of its own); the notice id."""
    from .._daemons import wait_subscribed  # noqa: PLC0415 - the daemon tests' helpers

    try:
        wait_subscribed(socket, {0, 1}, run)
        run.wait_for(fired, 120, "the moment of the notice")
        notice_id = drill(socket, deadline_in=deadline)
        run.wait(60)
        assert ref.wait(180) == 0, ref.tail()
    finally:
        run.kill()
        ref.kill()
    return notice_id
