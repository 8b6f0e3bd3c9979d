"""Time to safe: notice -> committed checkpoint at a random phase of an iteration, and the hook's per-step cost.

Issue 14's figures. Two parts, both real ``torchrun`` jobs (2 ranks, gloo, CPU):

**Notice -> committed** (one job per trial). A DDP model of ``LAYERS`` square
``Linear`` layers sized so that parameters + AdamW's two moments are 64 MiB or
1 GiB in total (replicated on both ranks; one AdamW step with synthetic
gradients gives every parameter its moments, then only the last layer trains,
so that the real compute of an iteration, DDP all-reduce and AdamW included,
stays far below 1.5 s on 2 cores even at 1 GiB: with every layer training it
took 2.6-4.5 s there), a ``LambdaLR`` scheduler and a stateful loader, under ``install_preemption_hook`` writing to a **local folder**
(``file://`` in a fresh temporary folder per trial: what is measured is the
hook's own path plus a local disk; object-store throughput is
``bench_storage.py``'s). An iteration is ``busy(s)`` (the forward/backward of a
real model: a sleep, then a spin for the last 2 ms) followed by the real DDP
forward/backward/all-reduce, ``opt.step()`` and ``sched.step()``; ``s`` is
calibrated in the job (``T`` minus the measured median of the real part over
warm-up iterations) so an iteration lasts ``T`` = 1.5 s or 10 s. After the
warm-up, rank 0 waits until the daemon lists both ranks as subscribers, then a
timer thread sends a ``preemption`` drill (deadline 30 s, as GCP and Azure
give) through a real ``spotguard daemon --cloud none`` at a uniformly random
phase of the next iteration. The figure is read from the hook's own log lines:
earliest ``notice_seen`` (any rank) -> latest ``checkpoint_committed`` (any rank),
their ``timestamp`` fields (same host clock). Also recorded: drill sent ->
committed, notice -> ``exit``, the step the checkpoint stands for against the
iterations completed when the drill was sent, and the workers' exit codes. The
drill is cancelled after each trial so the next job's intake gets no replay.

**Per-step overhead** (one job). A small DDP model, a 10 ms step (real
fwd/bwd/``opt.step()``/``sched.step()`` + ``busy``), blocks of steps with the hook
installed (``install_preemption_hook``, intake subscribed to the same daemon)
and without, interleaved in one job (A B, B A, ...) so drift hits both alike;
µs/step and % from the medians of the blocks, every block's figure kept.

**Loop shapes** (issue 23): ``--loop range`` writes the trial's loop as the README does (``for i in
hook.range(n)``, no ``hook.resume()`` call); ``--single`` runs one plain ``python`` process without
``torch.distributed`` (the one-GPU spot VM: no DDP, no process group); ``--busy-at forward`` puts the
simulated compute between the real forward and backward (where a real model spends it, so the forward
pre-hook fires at the start of the iteration's work) instead of before the loader (``before``, the
default, as the earlier results were measured).

**GAN** (issue 23): ``--gan N`` makes the model the discriminator (N steps per iteration) of a one-layer
generator with its own Adam (two optimizers); ``--busy-at split`` puts half the compute in the discriminator's
pass and half in the generator's, after the last discriminator step (where a notice waits for the iteration's
end: the state of the last one is gone), ``before`` all of it before the first step.

**Frameworks** (issue 23): ``--framework lightning,hf,accelerate`` (or ``all``) runs the same trials with the
framework owning the loop and accumulating gradients over ``ACCUM`` = 8 micro-batches: Lightning DDP
(``accumulate_grad_batches``), the transformers ``Trainer`` (DDP, ``gradient_accumulation_steps``) and
Accelerate (DDP, ``accelerator.accumulate``); workers in ``benchmarks/_tts_frameworks.py``. A cell's
``SECONDS`` is then one optimizer step (8 calibrated micro-batches), every layer trains, the drill lands at
a random phase of a step, and each trial also records the micro-batch index at the notice and whether the
commit came after the drill's deadline (``late``). Default cell 64 MiB, 10 s steps, 20 trials; ``--quick``:
1 MiB, 1.2 s steps, 2 trials. No overhead job (``bench_adapters.py`` measures the adapters' per-step cost).
``make bench-time-to-safe-frameworks`` runs the full framework set (~35 min on 2 shared cores).
``--compare-boundary`` runs every
trial twice in a row, the second with ``SPOTGUARD_BACKGROUND_AGREEMENT=0`` (the boundary path the adapters had
before their any-moment path), and summarises each path (``by_path``) from the same interleaved run;
``--baseline DIR`` does the same with another checkout's code first (before/after a change, on the same load;
also for the plain and ``--gan`` loops: that checkout's ``time_to_safe.py`` worker runs the trial).

``python -m benchmarks.time_to_safe [--quick] [--label NAME] [--cells MIB:SECONDS:TRIALS,...] [--framework F,...]``
writes ``benchmarks/results/time_to_safe-<label>.json``; ``--quick`` is a
smoke test (16 MiB, 0.6 s iterations, 2 trials, short overhead blocks) for
``tests/bench/test_time_to_safe.py``. ``make bench-time-to-safe`` runs the full set
(~30-40 min on 2 shared cores, most of it sleeping).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script by torchrun: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import busy, json_lines, log_time

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LAYERS = 8
WARMUP = 3  # iterations with no sleep; the median of the last two calibrates the sleep
AFTER = 5  # iterations the job may run after the notice's before the benchmark calls it a failure
DEADLINE_S = 30.0
CELLS = [(64, 1.5, 20), (64, 10.0, 20), (1024, 1.5, 20), (1024, 10.0, 12)]
QUICK_CELLS = [(16, 0.6, 2)]
FRAMEWORK_CELLS = [(64, 10.0, 20)]  # one optimizer step = 8 micro-batches of 1.25 s
FRAMEWORK_QUICK_CELLS = [(1, 1.2, 2)]
#: --compare-boundary: each trial on the adapter's any-moment path, then on the boundary path it had before
PATHS = {"any-moment": {}, "boundary": {"SPOTGUARD_BACKGROUND_AGREEMENT": "0"}}
TRIAL_PREFIX = "TTS_TRIAL "
OVERHEAD_PREFIX = "TTS_OVERHEAD "


# ----------------------------------------------------------------------------------------- workers

def _stateful_loader(dim: int) -> Any:
    import torch

    class Loader:
        """An endless loader whose position is checkpointed (the hook snapshots it per step)."""

        def __init__(self) -> None:
            self.pos = 0
            self.x = torch.randn(4, dim)

        def __iter__(self) -> "Loader":
            return self

        def __next__(self) -> Any:
            self.pos += 1
            return self.x

        def state_dict(self) -> dict[str, int]:
            return {"pos": self.pos}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.pos = int(sd["pos"])

    return Loader()


def _wait_subscribed(sock: str, n: int, timeout: float = 60.0) -> None:
    from spotguard.launch import query_status

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if len(query_status(sock)["subscribers"]) >= n:
                return
        except OSError:
            pass
        time.sleep(0.05)  # polling the daemon's status: nothing to await
    raise RuntimeError(f"the hook's intake did not subscribe to {sock} within {timeout} s")


def _local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def calibrate(iteration: Any, distributed: bool) -> float:
    """The real part of an iteration: ``WARMUP`` of them with no busy time, the median of all but the first,
    the slowest rank's (so every rank sleeps alike)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(WARMUP):
        t0 = time.perf_counter()
        iteration(0.0)
        times.append(time.perf_counter() - t0)
    real = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    if distributed:
        dist.all_reduce(real, op=dist.ReduceOp.MAX)
    return float(real[0])


def drill_at(sock: str, delay: float, info: dict[str, Any], done: list[int]) -> None:
    """Rank 0: ``delay`` s from now (a phase of the iteration starting now), a thread sends the ``preemption``
    drill through the daemon and emits ``info`` with the iterations completed then, when and the notice id."""
    from spotguard.daemon.client import request_sync
    from spotguard.protocol import Drill, DrillOk

    def send(t_iter: float) -> None:
        time.sleep(max(0.0, t_iter + delay - time.time()))
        info["completed_at_send"] = done[0]
        info["t_sent"] = time.time()
        reply = request_sync(sock, Drill(kind="preemption", deadline_in=DEADLINE_S), timeout=10.0)
        info["notice_id"] = reply.id if isinstance(reply, DrillOk) else None
        _emit(TRIAL_PREFIX, info)

    threading.Thread(target=send, args=(time.time(),), daemon=True).start()


def _trial_worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spotguard import install_preemption_hook

    state_mib = float(os.environ["SG_TTS_STATE_MIB"])
    period = float(os.environ["SG_TTS_ITER_S"])
    phase = float(os.environ["SG_TTS_PHASE"])
    sock = os.environ["SPOTGUARD_SOCKET"]
    single = os.environ.get("SG_TTS_SINGLE") == "1"
    loop = os.environ.get("SG_TTS_LOOP", "plain")
    busy_at = os.environ.get("SG_TTS_BUSY_AT", "before")
    world = 1
    if not single:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
    rank = dist.get_rank() if not single else 0
    torch.set_num_threads(1)
    dim = int(math.sqrt(state_mib * 2**20 / 12 / LAYERS))  # fp32 param + exp_avg + exp_avg_sq = 12 B each
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])
    fsdp2 = os.environ.get("SG_TTS_MODEL", "ddp") == "fsdp2"
    if fsdp2:  # every layer sharded over the 2 ranks (state per rank: half), all of it trains
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for p in net.parameters():  # one step with synthetic gradients: every parameter has AdamW's two moments
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if fsdp2:
        model = net
    else:
        for p in list(net.parameters())[:-1]:  # then only the last layer trains (see the module docstring)
            p.requires_grad_(False)
        model = net if single else DDP(net)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    loader = _stateful_loader(dim)
    gan = int(os.environ.get("SG_TTS_GAN", "0") or 0)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    if gan:  # the model above is the discriminator; a one-layer generator with its own Adam
        gnet = torch.nn.Linear(dim, dim, bias=False)
        gmodel = gnet if single else DDP(gnet)
        opt_g = torch.optim.Adam(gnet.parameters(), lr=1e-4)
        state["generator"], state["opt_g"] = gmodel, opt_g
    hook = install_preemption_hook(state, os.environ["SG_TTS_STORAGE"])
    steps = iter(hook.range(10**9)) if loop == "range" else None  # resumes at its first next()
    if steps is None:
        assert hook.resume() == 0
    done = [0]

    def gan_iteration(sleep_s: float) -> None:
        """``gan`` discriminator steps, then one generator step; the compute split evenly over the
        discriminator's pass (before its first step) and the generator's (after the last D step:
        ``--busy-at split``), or all of it in the discriminator's (``before``)."""
        d_part = sleep_s if busy_at == "before" else sleep_s / 2
        for c in range(gan):
            busy(d_part if c == 0 else 0.0)
            x = next(loader)
            opt.zero_grad(set_to_none=True)
            fake = gmodel(x).detach()
            (model(x).square().mean() - model(fake).square().mean()).backward()
            opt.step()
        busy(sleep_s - d_part)
        opt_g.zero_grad(set_to_none=True)
        model(gmodel(next(loader))).square().mean().backward()
        opt_g.step()
        sched.step()

    def iteration(sleep_s: float) -> None:
        if steps is not None:
            next(steps)  # the previous iteration's boundary, as a `for i in hook.range(n):` loop runs it
        if gan:
            gan_iteration(sleep_s)
            done[0] += 1
            return
        if busy_at == "before":
            busy(sleep_s)
        x = next(loader)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        if busy_at == "forward":
            busy(sleep_s)
        out.square().mean().backward()
        opt.step()
        sched.step()
        done[0] += 1

    real = calibrate(iteration, not single)
    sleep_s = max(0.0, period - real)
    if rank == 0:
        _wait_subscribed(sock, world)
    if not single:
        dist.barrier()
    state_bytes = sum(_local(t).numel() * _local(t).element_size() for p in net.parameters()
                      for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    if rank == 0:
        info: dict[str, Any] = {"real_part_s": round(real, 4), "sleep_s": round(sleep_s, 4),
                                "state_bytes": state_bytes, "phase": phase}
        drill_at(sock, phase * period, info, done)
    for _ in range(1 + AFTER):
        t0 = time.perf_counter()
        iteration(sleep_s)
        if rank == 0:
            _emit(TRIAL_PREFIX, {"iteration_s": round(time.perf_counter() - t0, 4), "done": done[0]})
    _emit(TRIAL_PREFIX, {"error": f"rank {rank} still training {AFTER} iterations after the notice"})
    sys.exit(3)


def _overhead_worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spotguard import install_preemption_hook

    step_s = float(os.environ.get("SG_TTS_STEP_S", "0.010"))
    blocks = int(os.environ.get("SG_TTS_BLOCKS", "6"))
    block_steps = int(os.environ.get("SG_TTS_BLOCK_STEPS", "150"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 50)
    loader = _stateful_loader(32)
    y = torch.randn(4, 1)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    base = tempfile.mkdtemp(prefix="sg-tts-overhead-") if rank == 0 else None
    box = [base]
    dist.broadcast_object_list(box, src=0)

    def loop(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x = next(loader)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            busy(step_s)
        return (time.perf_counter() - t0) / n

    loop(30)  # warm-up: DDP bucket rebuild, allocator
    res: dict[str, list[float]] = {"on": [], "off": []}
    for b in range(blocks):
        for on in ((False, True) if b % 2 == 0 else (True, False)):
            hook = install_preemption_hook(state, f"{box[0]}/b{b}") if on else None
            if hook is not None:
                hook.resume()
                loop(5)  # the hook's first steps (clock optimizer learned, first reduction) are not the steady state
            dist.barrier()
            res["on" if on else "off"].append(loop(block_steps))
            if hook is not None:
                hook.close()
            dist.barrier()
    if rank == 0:
        off, on = statistics.median(res["off"]), statistics.median(res["on"])
        _emit(OVERHEAD_PREFIX, {
            "step_target_ms": step_s * 1e3, "blocks": blocks, "block_steps": block_steps,
            "us_per_step_without": round(off * 1e6, 1), "us_per_step_with": round(on * 1e6, 1),
            "hook_us_per_step": round((on - off) * 1e6, 1), "overhead_pct": round((on / off - 1) * 100, 2),
            "blocks_us_without": [round(v * 1e6, 1) for v in res["off"]],
            "blocks_us_with": [round(v * 1e6, 1) for v in res["on"]],
        })
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- driver

def _torchrun(mode: str, env: dict[str, str], timeout: float, script: Optional[Path] = None) -> tuple[int, str]:
    """One 2-rank job of ``script``'s (default: this file's) ``--worker mode`` (``SG_TTS_SINGLE=1``: one plain
    process); (exit code or -1 on timeout, its output). Its own session, killed whole on a timeout or when the
    benchmark stops."""
    torchrun = Path(sys.executable).parent / "torchrun"
    repo = Path(env.get("SG_TTS_REPO", REPO))  # --baseline: another checkout's code
    script = script if script is not None or repo == REPO else repo / "benchmarks" / "time_to_safe.py"
    job_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SPOTGUARD_LOG_LEVEL": "info",
               "SPOTGUARD_LOG_FORMAT": "json", **env,
               "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launcher = [sys.executable] if job_env.get("SG_TTS_SINGLE") == "1" else \
        [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen([*launcher, str((script or Path(__file__)).resolve()), "--worker", mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=job_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            return -1, out
        raise


def _prefixed(text: str, prefix: str) -> list[dict[str, Any]]:
    """The benchmark's own result objects: the JSON object right after each ``prefix`` (a line another
    process's output ran into is still read; anything unreadable is skipped)."""
    out = []
    dec = json.JSONDecoder()
    for line in text.splitlines():
        i = line.find(prefix)
        while i >= 0:
            try:
                obj, _ = dec.raw_decode(line, i + len(prefix))
                out.append(obj)
            except ValueError:
                pass
            i = line.find(prefix, i + len(prefix))
    return out


def _emit(prefix: str, obj: dict[str, Any]) -> None:
    """One write per result line (``print`` writes text and newline apart: two threads interleave)."""
    sys.stdout.write(prefix + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _trial(sock: str, work: Path, mib: float, period: float, phase: float,
           framework: Optional[str] = None, extra: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """One job, one drill; ``framework``: a ``_tts_frameworks`` worker (the loop is the framework's)."""
    store = Path(tempfile.mkdtemp(prefix="ckpt-", dir=work))
    env = {"SG_TTS_STATE_MIB": str(mib), "SG_TTS_ITER_S": str(period), "SG_TTS_PHASE": repr(phase),
           "SG_TTS_STORAGE": str(store), "SPOTGUARD_SOCKET": sock}
    if framework:
        base, _, path = framework.partition("@")  # hf@boundary: the same worker on the boundary path
        env["SG_TTS_FRAMEWORK"] = base
        if path == "boundary":
            env["SPOTGUARD_BACKGROUND_AGREEMENT"] = "0"
    else:
        env["SG_TTS_MODEL"] = os.environ.get("SG_TTS_MODEL", "ddp")
        env.update({k: os.environ[k] for k in ("SG_TTS_SINGLE", "SG_TTS_LOOP", "SG_TTS_BUSY_AT", "SG_TTS_GAN") if k in os.environ})
    env.update(extra or {})  # --baseline: SG_TTS_REPO, the other checkout's worker and code
    rc, text = _torchrun("framework" if framework else "trial", env,
                         timeout=(180 if framework else 120) + 12 * period + mib / 20)
    info: dict[str, Any] = {}
    iters: list[float] = []
    micros: list[tuple[float, int, int]] = []  # (time, optimizer steps done, micro-batch index): frameworks
    for d in _prefixed(text, TRIAL_PREFIX):
        if "iteration_s" in d:
            iters.append(d["iteration_s"])
        elif "micro_start" in d:
            micros.append((float(d["micro_start"]), int(d["step"]), int(d["micro"])))
        else:
            info.update(d)
    hook = [e for e in json_lines(text) if e.get("component") == "hook"]
    nid = info.get("notice_id")
    if nid:
        _cancel(sock, nid)
    out: dict[str, Any] = {"phase": round(phase, 4), "torchrun_rc": rc, **{k: info[k] for k in
                           ("real_part_s", "sleep_s", "state_bytes", "completed_at_send", "micro_at_send")
                           if k in info}}
    out["iterations_s"] = iters
    if micros:  # frameworks: how long each paced micro-batch lasted (a job that exits mid-step has no whole step)
        starts = sorted(m[0] for m in micros)
        out["micro_batches_s"] = [round(b - a, 4) for a, b in zip(starts, starts[1:])]
    t_seen = hook_figures(out, hook, info, text)
    at = [m for m in sorted(micros) if t_seen is not None and m[0] <= t_seen]
    if at:  # the micro-batch (of the optimizer step after ``step_at_notice`` completed ones) running at the notice
        out["step_at_notice"], out["micro_at_notice"] = at[-1][1], at[-1][2]
    return out


def hook_figures(out: dict[str, Any], hook: list[dict[str, Any]], info: dict[str, Any], text: str) -> Optional[float]:
    """Into ``out``: the trial's figures from the hook's log lines of ``info["notice_id"]`` (notice_seen ->
    checkpoint_committed, -> exit; drill sent -> committed), or its ``error``; returns notice_seen's time."""
    nid = info.get("notice_id")
    mine = [e for e in hook if e.get("notice_id") == nid] if nid else []
    seen = [e for e in mine if e.get("event") == "notice_seen"]
    committed = [e for e in mine if e.get("event") == "checkpoint_committed"]
    exits = [e for e in mine if e.get("event") == "exit"]
    if "error" in info or not seen or not committed:
        out["error"] = info.get("error") or ("no notice_seen" if not seen else "no checkpoint_committed")
        out["late"] = True  # never safe
        out["tail"] = text[-3000:]
        return None
    t_seen, t_commit = min(map(log_time, seen)), max(map(log_time, committed))
    out["notice_to_committed_s"] = round(t_commit - t_seen, 4)
    out["sent_to_committed_s"] = round(t_commit - info["t_sent"], 4)
    out["late"] = out["sent_to_committed_s"] > DEADLINE_S  # committed after the VM would be gone
    if exits:
        out["notice_to_exit_s"] = round(max(map(log_time, exits)) - t_seen, 4)
        out["exit_codes"] = sorted(int(e["code"]) for e in exits)
    out["committed_step"] = int(committed[0]["step"])
    out["seconds_left_at_commit"] = min(float(e.get("seconds_left", float("nan"))) for e in committed)
    out["profile"] = profile(mine, t_seen)
    if "completed_at_send" in info:
        out["steps_after_notice"] = out["committed_step"] - int(info["completed_at_send"])
    return t_seen


def profile(mine: list[dict[str, Any]], t_seen: float) -> dict[str, Any]:
    """Where the time between the notice and the commit goes, per rank: each timeline line's time after the
    first ``notice_seen`` (the last one of a kind), and the parts an adapter's ``checkpoint_staged`` names."""
    out: dict[str, Any] = {}
    for e in mine:
        r = out.setdefault(f"rank{e.get('rank', 0)}", {})
        r[e["event"]] = round(log_time(e) - t_seen, 4)
        if e["event"] == "checkpoint_staged" and isinstance(e.get("parts"), dict):
            r["parts"] = e["parts"]
        if "seconds" in e and e["event"] not in ("checkpoint_staged",):
            r[e["event"] + "_seconds"] = e["seconds"]
    return out


def _cancel(sock: str, nid: str) -> None:
    from spotguard.daemon.client import request_sync
    from spotguard.protocol import DrillCancel

    try:
        request_sync(sock, DrillCancel(id=nid), timeout=5.0)
    except Exception as exc:  # noqa: BLE001 - an expired drill is gone already; the next trial would see a replay
        print(f"drill cancel {nid}: {exc!r}", file=sys.stderr)


def _pct(xs: list[float], q: float) -> float:
    """Percentile, linear between order statistics (with 20 samples p99 lies between the two largest)."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(_pct(xs, 0.5), 3), "p90": round(_pct(xs, 0.9), 3),
            "p99": round(_pct(xs, 0.99), 3),
            "min": round(min(xs), 3), "max": round(max(xs), 3),
            "stdev": round(statistics.stdev(xs), 3) if len(xs) > 1 else 0.0}


def _cell(sock: str, work: Path, mib: float, period: float, trials: int, rng: random.Random,
          framework: Optional[str] = None) -> dict[str, Any]:
    runs = []
    name = f"{framework + '/' if framework else ''}{mib:g}MiB/{period:g}s"
    paths = PATHS if framework and os.environ.get("SG_TTS_COMPARE") == "1" else {"": {}}
    if os.environ.get("SG_TTS_BASELINE"):  # --baseline: that checkout's code, then this one's
        paths = {"baseline": {"SG_TTS_REPO": os.environ["SG_TTS_BASELINE"]}, "this": {}}
    for i in range(trials):
        phase = rng.random()  # both paths at the same phase of the step
        for label, extra in paths.items():
            r = _trial(sock, work, mib, period, phase, framework, extra)
            if label:
                r["path"] = label
            runs.append(r)
            print(json.dumps({"cell": name, "trial": i, **{k: v for k, v in r.items() if k != "tail"}}), flush=True)
    ok = [r for r in runs if "notice_to_committed_s" in r]
    cell: dict[str, Any] = {"framework": framework} if framework else {}
    if framework:
        from benchmarks._tts_frameworks import ACCUM

        cell.update(accumulate=ACCUM, micro_batch_s=round(period / ACCUM, 4),
                    micro_at_notice=[r.get("micro_at_notice") for r in runs])
    cell.update({
        "state_mib": mib, "iteration_s": period, "trials": trials, "failed": len(runs) - len(ok),
        "late": sum(bool(r.get("late")) for r in runs),
        "notice_to_committed_s": _summary([r["notice_to_committed_s"] for r in ok]),
        "sent_to_committed_s": _summary([r["sent_to_committed_s"] for r in ok]),
        "notice_to_exit_s": _summary([r["notice_to_exit_s"] for r in ok if "notice_to_exit_s" in r]),
        "steps_after_notice": sorted({r.get("steps_after_notice") for r in ok} - {None}),
        "measured_iteration_s": _summary([x for r in ok for x in r["iterations_s"]]),
        **({"measured_micro_batch_s": _summary([x for r in ok for x in r.get("micro_batches_s", [])])}
           if framework else {}),
        "runs": runs,
    })
    if len(paths) > 1:
        cell["by_path"] = {p: {"trials": sum(r.get("path") == p for r in runs),
                               "late": sum(bool(r.get("late")) for r in runs if r.get("path") == p),
                               "notice_to_committed_s": _summary([r["notice_to_committed_s"] for r in ok
                                                                  if r.get("path") == p])} for p in paths}
    if mib <= 64:
        cell["meets_target_p99_1s"] = bool(ok) and cell["notice_to_committed_s"]["p99"] <= 1.0
    return cell


def bench(cells: list[tuple[float, float, int]], *, overhead_blocks: int, overhead_steps: int,
          seed: int, partial: Optional[Path] = None, frameworks: tuple[Optional[str], ...] = (None,)) -> dict[str, Any]:
    """Every cell (for each of ``frameworks``; None: the plain loop), then the overhead job; with
    ``partial``, what is done so far is written there after each cell."""
    from spotguard.launch import start_daemon

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="sg-tts-"))
    sock = str(work / "sg.sock")
    daemon = start_daemon(sock, cloud="none", log_path=work / "daemon.log")
    t0 = time.monotonic()
    try:
        shape = "1 plain process, no torch.distributed" if os.environ.get("SG_TTS_SINGLE") == "1" else \
            "2 ranks torchrun gloo CPU"
        if frameworks != (None,):
            shape += f"; frameworks {', '.join(f or 'plain' for f in frameworks)}, " \
                     f"{os.environ.get('SG_TTS_ACCUM', '8')}-micro-batch accumulation, " \
                     "the drill at a random phase of an optimizer step"
        out: dict[str, Any] = {
            "what": "notice_seen -> checkpoint_committed (hook log timestamps), drill through a real daemon at a "
                    f"uniformly random phase of an iteration; {shape}; local-folder storage",
            "loop": os.environ.get("SG_TTS_LOOP", "plain"), "single_process": os.environ.get("SG_TTS_SINGLE") == "1",
            "busy_at": os.environ.get("SG_TTS_BUSY_AT", "before"),
            "gan_critic_steps": int(os.environ.get("SG_TTS_GAN", "0") or 0),
            "storage": "local folder (file://, tmp); object-store throughput: bench_storage.py",
            "deadline_s": DEADLINE_S, "seed": seed, "load_avg_start": os.getloadavg(), "cells": [],
        }
        for framework, (mib, period, trials) in ((f, c) for f in frameworks for c in cells):
            out["cells"].append(_cell(sock, work, mib, period, trials, rng, framework))
            out["cells"][-1]["load_avg_after"] = os.getloadavg()
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({**out, "partial": True}, indent=2) + "\n")
        if overhead_blocks:
            out["overhead_10ms"] = _overhead(sock, overhead_blocks, overhead_steps)
        out["load_avg_end"] = os.getloadavg()
        out["wall_s"] = round(time.monotonic() - t0, 1)
        return out
    finally:
        daemon.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _overhead(sock: str, blocks: int, steps: int) -> dict[str, Any]:
    rc, text = _torchrun("overhead", {"SPOTGUARD_SOCKET": sock, "SG_TTS_BLOCKS": str(blocks),
                                      "SG_TTS_BLOCK_STEPS": str(steps)}, timeout=600)
    got = _prefixed(text, OVERHEAD_PREFIX)
    if not got:
        return {"error": f"overhead job printed no result (rc {rc})", "tail": text[-3000:]}
    return {**got[-1], "meets_target_2pct": got[-1]["overhead_pct"] <= 2.0}


def _parse_cells(spec: str) -> list[tuple[float, float, int]]:
    cells = []
    for part in spec.split(","):
        mib, secs, n = part.split(":")
        cells.append((float(mib), float(secs), int(n)))
    return cells


def run() -> dict[str, Any]:
    """``python -m benchmarks time_to_safe``: the full set."""
    return bench(CELLS, overhead_blocks=6, overhead_steps=150, seed=14)


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the daemon and the job are ended too
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: one small cell, 2 trials, short overhead")
    ap.add_argument("--cells", help="MIB:SECONDS:TRIALS,... (default: 64/1024 MiB x 1.5/10 s)")
    ap.add_argument("--label", default="latest", help="results file name: time_to_safe-<label>.json")
    ap.add_argument("--out", help="results file (default benchmarks/results/time_to_safe-<label>.json)")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--model", choices=("ddp", "fsdp2"), default="ddp",
                    help="fsdp2: every layer fully_shard-ed (its state-dict hooks send notices to the fallback read)")
    ap.add_argument("--loop", choices=("plain", "range"), default="plain",
                    help="range: the README's `for i in hook.range(n)` loop (default: hook.resume() + own loop)")
    ap.add_argument("--single", action="store_true", help="one plain process without torch.distributed")
    ap.add_argument("--busy-at", choices=("before", "forward", "split"), default="before",
                    help="the simulated compute before the loader (default) or between forward and backward; "
                         "--gan: all in the discriminator's pass (before) or half there, half in the generator's "
                         "(split)")
    ap.add_argument("--gan", type=int, default=0, metavar="N",
                    help="a GAN: the model is the discriminator (N steps per iteration), then a generator step "
                         "(its own optimizer); the drill lands at a random phase of the whole iteration")
    ap.add_argument("--framework", help="lightning,hf,accelerate (comma-separated) or all: the framework owns the "
                                        "loop, 8-micro-batch gradient accumulation; SECONDS of a cell = one step; "
                                        "NAME@boundary: the same with SPOTGUARD_BACKGROUND_AGREEMENT=0 (the "
                                        "boundary path), e.g. hf,hf@boundary")
    ap.add_argument("--accum", type=int, default=None, help="--framework: micro-batches an optimizer step "
                                                            "(default 8; 1: no gradient accumulation)")
    ap.add_argument("--compare-boundary", action="store_true",
                    help="--framework: every trial run twice at the same phase, the second with "
                         "SPOTGUARD_BACKGROUND_AGREEMENT=0 (the boundary path), summarised per path (by_path)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="--framework: every trial run twice at the same phase, first with the code of the checkout "
                         "DIR (e.g. the main branch: before a change), then this one's, summarised per path (by_path)")
    a = ap.parse_args(argv)
    if a.baseline:
        os.environ["SG_TTS_BASELINE"] = str(Path(a.baseline).resolve())
    if a.compare_boundary:
        os.environ["SG_TTS_COMPARE"] = "1"
    frameworks: tuple[Optional[str], ...] = (None,)
    if a.accum is not None:
        if not a.framework or a.accum < 1:
            ap.error("--accum N (>= 1): with --framework only")
        os.environ["SG_TTS_ACCUM"] = str(a.accum)  # before _tts_frameworks is imported (its ACCUM)
    if a.framework:
        from benchmarks._tts_frameworks import FRAMEWORKS

        frameworks = FRAMEWORKS if a.framework == "all" else tuple(a.framework.split(","))
        if {f.partition("@")[0] for f in frameworks} - set(FRAMEWORKS) or \
                {f.partition("@")[2] for f in frameworks} - {"", "boundary"}:
            ap.error(f"--framework: one or more of {', '.join(FRAMEWORKS)}, or all")
        if a.single or a.model != "ddp" or a.loop != "plain" or a.busy_at != "before":
            ap.error("--framework: the framework owns the loop (2 ranks, DDP): no --single/--model/--loop/--busy-at")
    os.environ["SG_TTS_MODEL"] = a.model
    os.environ["SG_TTS_LOOP"] = a.loop
    os.environ["SG_TTS_BUSY_AT"] = a.busy_at
    if a.gan:
        if a.framework or a.model != "ddp" or a.busy_at == "forward":
            ap.error("--gan: the plain DDP model as the discriminator; --busy-at before or split")
        os.environ["SG_TTS_GAN"] = str(a.gan)
    elif a.busy_at == "split":
        ap.error("--busy-at split: only with --gan")
    if a.single:
        if a.model != "ddp":
            ap.error("--single runs one process: no --model fsdp2")
        os.environ["SG_TTS_SINGLE"] = "1"
    if a.framework:
        cells = _parse_cells(a.cells) if a.cells else (FRAMEWORK_QUICK_CELLS if a.quick else FRAMEWORK_CELLS)
    else:
        cells = _parse_cells(a.cells) if a.cells else (QUICK_CELLS if a.quick else CELLS)
    blocks, steps = (2, 40) if a.quick else (6, 150)
    if a.no_overhead or a.framework:
        blocks = 0
    path = Path(a.out) if a.out else RESULTS / f"time_to_safe-{a.label}.json"
    result = bench(cells, overhead_blocks=blocks, overhead_steps=steps, seed=a.seed, partial=path,
                   frameworks=frameworks)
    result["label"] = a.label
    result["quick"] = a.quick
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    short = {"cells": [{k: c[k] for k in ("framework", "state_mib", "iteration_s", "failed", "late",
                                          "notice_to_committed_s", "steps_after_notice") if k in c}
                       for c in result["cells"]],
             "overhead_10ms": {k: v for k, v in result.get("overhead_10ms", {}).items()
                               if not k.startswith("blocks") and k != "tail"},
             "results": str(path)}
    print(json.dumps(short, indent=2))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        def _framework_worker() -> None:
            from benchmarks._tts_frameworks import worker

            worker()

        {"trial": _trial_worker, "overhead": _overhead_worker,
         "framework": _framework_worker}[sys.argv[sys.argv.index("--worker") + 1]]()
    else:
        sys.exit(main(sys.argv[1:]))
