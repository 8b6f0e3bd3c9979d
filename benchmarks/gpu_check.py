"""GPU proof kit: one command that checks spotguard's CUDA and NCCL paths and prints one JSON summary.

    python -m benchmarks.gpu_check        (or: make gpu-check)

Where no CUDA device exists it prints one ``SKIP`` line and exits 0 (CI stays
green). On a GPU it runs each check in its own process (a plain child, or a
``torchrun`` job) with its own time budget, so a failed or hung check never
hides the others, and writes the summary to ``$OUT/gpu_check.json`` when
``$OUT`` is set. Each check states its threshold next to its figures:

- ``rng``: a 1-GPU torchrun job (NCCL) with dropout and deterministic
  cuDNN/cuBLAS settings, preempted at step 4 by the real hook and resumed,
  gives bitwise the losses of the uninterrupted run (threshold: bitwise equal).
- ``staging``: device→host GiB/s of 8 GiB of CUDA tensors through the staging
  pool vs a pinned ``cudaMemcpy`` into one pinned buffer in the same run
  (threshold: >= 70 %), pageable ``.cpu()`` for reference, host memory peak
  (threshold: growth <= pool + 512 MiB).
- ``commit_local`` / ``commit_s3``: notice → committed for 8 GiB of CUDA
  model + Adam state through the hook to local disk and to the S3 sink
  (``benchmarks/s3sink.py``), vs a rank-0 ``torch.save`` of the same state
  (threshold: <= 1.25 x torch.save; a first guess, see docs/performance.md).
- ``nccl_1`` / ``nccl_2``: an NCCL group of 1 process (and of 2 sharing the
  GPU where NCCL allows it; else the error is recorded): NCCL all-reduce,
  the hook's gloo agreement while a long CUDA kernel runs (threshold: done
  while the kernel still runs, < 2 s), the hook's save and exit, and bounded
  destroy (abort if it hangs) of the NCCL group (threshold: <= 5 s).
- ``anytime``: notices from another thread at random moments while CUDA kernels are queued (a plain
  process and a 1-GPU torchrun job): every resumed state bitwise the uninterrupted run's at its step
  (threshold: all exact, at most one step lost).
- ``torchft``: one torchft replica group on its NCCL process group, a notice, the whole-job leave and a
  resumed job (threshold: every step commits, resume bitwise, the scheduler on its schedule).
- ``overhead``: per-step cost of the hook on a small bf16 transformer step
  with no notice, interleaved A/B blocks (threshold: <= 2 %).

``SG_GPU_CHECK_DEVICE=cpu`` runs the same checks on the CPU with gloo and tiny
sizes: a dry run of the script's plumbing only, never a GPU figure.
``SG_GPU_CHECK_GIB`` sets the state size (default 8), ``SG_GPU_CHECK_ONLY``
a comma-separated subset.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks._util import RESULT_PREFIX, REPO, free_port, print_result

GiB = 1 << 30
#: total wall budget the checks are sized to (the device call gets ~8-10 minutes)
TOTAL_BUDGET_S = 520


def _device_kind() -> str:
    """``cuda`` | ``cpu`` (forced dry run) | ``none`` | ``notorch`` (this Python cannot import torch)."""
    forced = os.environ.get("SG_GPU_CHECK_DEVICE", "")
    if forced == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        return "notorch"

    return "cuda" if torch.cuda.is_available() else "none"


def _gib() -> float:
    default = "8" if _device_kind() == "cuda" else "0.03"
    return float(os.environ.get("SG_GPU_CHECK_GIB", default))


def _dev() -> Any:
    import torch

    if _device_kind() == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def _sync() -> None:
    import torch

    if _device_kind() == "cuda":
        torch.cuda.synchronize()


def _init_dist(backend_env: str = "SG_GPU_CHECK_BACKEND") -> Any:
    import torch.distributed as dist

    backend = os.environ.get(backend_env) or ("nccl" if _device_kind() == "cuda" else "gloo")
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=_dev())
    else:
        dist.init_process_group(backend)
    return dist


# ---------------------------------------------------------------------------------------------------
# workers (run as children: ``--worker NAME``)


def _w_rng() -> None:
    """Reference run, then the hooked run preempted at ``--notify-at`` (phase pre); or resume to the end."""
    import torch
    from datetime import timedelta

    phase, storage = sys.argv[sys.argv.index("--phase") + 1], sys.argv[sys.argv.index("--storage") + 1]
    steps, notify_at = 10, 4
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    dist = _init_dist()
    dev = _dev()

    def build() -> tuple[dict[str, Any], Callable[[], Any]]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                  torch.nn.Linear(512, 1)).to(dev)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)

        def step() -> Any:
            x = torch.randn(64, 64, device=dev)  # drawn from the device's RNG, like dropout's mask
            opt.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        return {"model": net, "optimizer": opt}, step

    flags = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
             "cudnn_deterministic": torch.backends.cudnn.deterministic,
             "cudnn_benchmark": torch.backends.cudnn.benchmark,
             "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    print(json.dumps({"flags": flags}), flush=True)
    if phase == "pre":
        _, step = build()
        for i in range(steps):
            print(json.dumps({"ref": i, "hex": step().item().hex()}), flush=True)
    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    state, step = build()
    hook = install_preemption_hook(state, storage=storage)
    start = hook.resume()
    for i in range(start, steps):
        if phase == "pre" and i == notify_at:
            now = utcnow()
            hook.notify(Notice(id="gpu-rng", source="drill", kind="preemption",
                               deadline=now + timedelta(seconds=60), received_at=now))
        print(json.dumps({"step": i, "hex": step().item().hex()}), flush=True)
    dist.destroy_process_group()


def _w_staging() -> None:
    """Pool staging vs pinned-memcpy bound vs pageable .cpu(), same tensors, same run."""
    import torch

    from spotguard.storage.staging import shared_stager

    dev, gib = _dev(), _gib()
    n_per = min(GiB, int(gib * GiB)) // 4 * 4
    count = max(1, round(gib * GiB / n_per))
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = [torch.randn(n_per // 4, device=dev, generator=g) for _ in range(count)]  # random, not zeros
    _sync()
    total = sum(t.nbytes for t in tensors)
    stager = shared_stager()
    for _ in stager.chunks(tensors[0], 0, min(tensors[0].nbytes, stager.pool.chunk * stager.pool.count)):
        pass  # allocate the pool (pinned) before measuring
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    for t in tensors:
        for _view in stager.chunks(t):
            pass
    t_stage = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    part = bytearray(stager.pool.chunk)  # with the consumer's host copy (what the part uploader does)
    t0 = time.perf_counter()
    for t in tensors:
        for view in stager.chunks(t):
            part[:len(view)] = view
    t_stage_copy = time.perf_counter() - t0
    pinned = torch.empty(n_per, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    for t in tensors[:1]:  # warm-up
        pinned.copy_(t.view(torch.uint8), non_blocking=True)
    _sync()
    t0 = time.perf_counter()
    for t in tensors:
        pinned.copy_(t.view(torch.uint8), non_blocking=True)
        _sync()
    t_bound = time.perf_counter() - t0
    t0 = time.perf_counter()
    host = tensors[0].cpu()
    t_pageable = time.perf_counter() - t0
    del host
    stage_gibps, bound_gibps = total / GiB / t_stage, total / GiB / t_bound
    growth = max(0, rss1 - rss0)
    limit = stager.pool.allocated_bytes + 512 * (1 << 20)
    print_result({
        "gib": round(total / GiB, 3), "pool_buffers": stager.pool.count, "chunk_mib": stager.pool.chunk >> 20,
        "pinned": stager.pool.pinned,
        "staging_gibps": round(stage_gibps, 2), "staging_with_host_copy_gibps": round(total / GiB / t_stage_copy, 2),
        "pinned_memcpy_bound_gibps": round(bound_gibps, 2),
        "pageable_cpu_gibps": round(tensors[0].nbytes / GiB / t_pageable, 2),
        "fraction_of_bound": round(stage_gibps / bound_gibps, 3),
        "host_peak_growth_mib": round(growth / (1 << 20), 1), "host_growth_limit_mib": round(limit / (1 << 20), 1),
        "pool_peak_in_use": stager.pool.peak_in_use,
        "threshold": "staging >= 70% of the pinned memcpy bound; host growth <= pool + 512 MiB",
        "pass": stage_gibps >= 0.7 * bound_gibps and growth <= limit,
    })


def _big_state(dev: Any, gib: float) -> tuple[Any, Any]:
    """Model + Adam state of about ``gib`` GiB (parameters a third, Adam's two moments the rest)."""
    import torch

    width = 8192 if gib >= 1 else 256
    layer_bytes = width * width * 4
    layers = max(1, round(gib * GiB / 3 / layer_bytes))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return net, opt


def _w_commit() -> None:
    """rank-0 torch.save of the state (+fsync), then the hook's notice → committed for the same state."""
    import torch
    from datetime import timedelta

    storage = sys.argv[sys.argv.index("--storage") + 1]
    dist = _init_dist()
    dev = _dev()
    net, opt = _big_state(dev, _gib())
    _sync()
    nbytes = sum(p.nbytes for p in net.parameters()) + sum(
        v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    baseline: dict[str, Any] = {}
    if os.environ.get("SG_GPU_CHECK_TORCH_SAVE") == "1":
        path = Path(tempfile.mkdtemp(prefix="sg-gpu-tsave-")) / "ckpt.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        baseline = {"torch_save_s": round(time.perf_counter() - t0, 3)}
        path.unlink()
    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    hook = install_preemption_hook({"model": net, "optimizer": opt}, storage=storage)
    hook.resume()
    x = torch.randn(4, net[0].in_features, device=dev)
    # one trained step first: a notice before any step has nothing to save (the hook then writes nothing)
    opt.zero_grad(set_to_none=True)
    net(x).sum().backward()
    opt.step()
    _sync()
    now = utcnow()
    print(json.dumps({"state_bytes": nbytes, **baseline, "notify_wall": time.time()}), flush=True)
    hook.notify(Notice(id="gpu-commit", source="drill", kind="preemption",
                       deadline=now + timedelta(seconds=120), received_at=now))
    for _ in range(50):  # the boundaries: agreement, save, commit, exit (Preempted)
        opt.zero_grad(set_to_none=True)
        net(x).sum().backward()
        opt.step()
    print(json.dumps({"error": "no Preempted after 50 steps"}), flush=True)
    dist.destroy_process_group()


def _w_nccl() -> None:
    """NCCL all-reduce; the hook's gloo agreement during a long kernel; the hook's exit; bounded destroy."""
    import torch
    from datetime import timedelta

    storage = sys.argv[sys.argv.index("--storage") + 1]
    out: dict[str, Any] = {}
    dist = _init_dist()
    dev, rank, world = _dev(), dist.get_rank(), dist.get_world_size()
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t)
    _sync()
    out["allreduce_ok"] = bool((t == world).all().item())
    out["backend"] = str(dist.get_backend())
    from spotguard.hook.dist import make_group

    group = make_group()  # the hook's own kind of group: gloo, separate from the NCCL one
    a = torch.randn(8192 if dev.type == "cuda" else 256, 8192 if dev.type == "cuda" else 256, device=dev)
    _sync()
    t0 = time.perf_counter()
    for _ in range(120 if dev.type == "cuda" else 1):
        a = torch.tanh(a @ a)  # ~3 s of queued work on an H200 (fp32)
    flag = torch.tensor([rank + 1], dtype=torch.int64)
    torch.distributed.all_reduce(flag, group=group)
    agree_s = time.perf_counter() - t0
    still_running = dev.type == "cuda" and not torch.cuda.current_stream().query()
    _sync()
    kernel_s = time.perf_counter() - t0
    out.update({"gloo_agree_s": round(agree_s, 4), "kernel_still_running_at_agreement": still_running,
                "kernel_s": round(kernel_s, 3), "agree_ok": int(flag.item()) == world * (world + 1) // 2})
    from spotguard import install_preemption_hook
    from spotguard.hook.core import Preempted
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    hook = install_preemption_hook({"model": net, "optimizer": opt}, storage=storage)
    hook.resume()
    opt.zero_grad(set_to_none=True)  # one trained step first (a notice before any step has nothing to save)
    net(torch.randn(8, 256, device=dev)).sum().backward()
    opt.step()
    now = utcnow()
    hook.notify(Notice(id="gpu-nccl", source="drill", kind="preemption",
                       deadline=now + timedelta(seconds=120), received_at=now))
    t_notify = time.perf_counter()
    try:
        for _ in range(50):
            opt.zero_grad(set_to_none=True)
            net(torch.randn(8, 256, device=dev)).sum().backward()
            opt.step()
        out["preempted"] = False
    except Preempted as exc:
        out.update({"preempted": True, "committed": exc.committed, "code": exc.code,
                    "notice_to_preempted_s": round(time.perf_counter() - t_notify, 3)})
    from spotguard.hook.dist import _abort_all, run_bounded

    t1 = time.perf_counter()
    ok, err = run_bounded(dist.destroy_process_group if dist.is_initialized() else (lambda: None), 5.0,
                          "gpu-check-destroy")
    destroy_s = time.perf_counter() - t1
    out["destroy_s"], out["destroy_method"] = round(destroy_s, 3), "destroy" if ok else "timeout"
    if err is not None:
        out["destroy_error"] = f"{type(err).__name__}: {err}"
    if not ok:  # what the hook does when peers are gone: abort, also bounded
        t1 = time.perf_counter()
        aborted, _err = run_bounded(_abort_all, 5.0, "gpu-check-abort")
        out["abort_s"], out["destroy_method"] = round(time.perf_counter() - t1, 3), "abort" if aborted else "timeout"
    out["teardown_pass"] = ok and destroy_s <= 5.0
    out["threshold"] = "agreement while the kernel runs, < 2 s; NCCL destroy <= 5 s"
    out["pass"] = (out["allreduce_ok"] and out["agree_ok"] and agree_s < 2.0
                   and (still_running or dev.type != "cuda") and out["teardown_pass"] and out.get("committed", False))
    if rank == 0:
        print_result(out)
    sys.stdout.flush()
    os._exit(0 if out["pass"] else 1)


def _w_overhead() -> None:
    """Hook on vs off around a small bf16 transformer step, interleaved blocks, median per step."""
    import statistics

    import torch

    from spotguard.hook import Hook

    dist = _init_dist()
    dev = _dev()
    cuda = dev.type == "cuda"
    d, layers, seq, batch = (1024, 8, 512, 16) if cuda else (32, 1, 8, 2)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, 16 if cuda else 4, 4 * d, dropout=0.1, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, layers).to(dev, torch.bfloat16 if cuda else torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, d, device=dev, dtype=next(net.parameters()).dtype)
    store = tempfile.mkdtemp(prefix="sg-gpu-ovh-")

    def block(n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            net(x).float().pow(2).mean().backward()
            opt.step()
        _sync()
        return (time.perf_counter() - t0) / n

    block(10)
    res: dict[str, list[float]] = {"on": [], "off": []}
    for b in range(8):
        for on in ((False, True) if b % 2 == 0 else (True, False)):
            hook = Hook({"model": net, "optimizer": opt}, store, signals=False, intake=False) if on else None
            if hook is not None:
                hook.resume()
            res["on" if on else "off"].append(block(25 if cuda else 5))
            if hook is not None:
                hook._agree.drop()
                hook.close()
    on, off = statistics.median(res["on"]), statistics.median(res["off"])
    pct = (on / off - 1) * 100
    print_result({"step_ms_without": round(off * 1e3, 3), "step_ms_with": round(on * 1e3, 3),
                  "overhead_pct": round(pct, 2),
                  "spread_pct_off": round((max(res["off"]) - min(res["off"])) / off * 100, 2),
                  "model": f"TransformerEncoder d={d} layers={layers} seq={seq} batch={batch} "
                           f"{'bf16' if cuda else 'fp32'}",
                  "threshold": "overhead <= 2%", "pass": pct <= 2.0})
    dist.destroy_process_group()


def _anytime_build(dev: Any, seed: int = 0) -> tuple[Any, Any, Any, Callable[[int], None]]:
    """A CUDA loop whose kernels queue deep (no host sync per step): BatchNorm, dropout, AdamW, an EMA model."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    cuda = dev.type == "cuda"
    width, depth, batch = (2048, 6, 8192) if cuda else (128, 2, 256)
    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def step(i: int) -> None:
        g = torch.Generator(device=dev).manual_seed(1000 + i)  # the batch is a function of the step
        x = torch.randn(batch, width, device=dev, generator=g)
        y = x[:, :8].sum(dim=1, keepdim=True).sin()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        ema.update_parameters(net)

    return net, opt, ema, step


def _fingerprint(t: Any) -> Any:
    """Two int64 sums over a tensor's bits, computed where it lives: any changed bit changes the first
    (odd weights), and it costs a kernel, not a device-to-host copy of the whole state per step."""
    import torch

    x = t.detach().contiguous().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    x = (x if not x.is_floating_point() and x.dtype != torch.bool else x.view(ints[x.element_size()])
         if x.dtype != torch.bool else x.to(torch.uint8)).to(torch.int64)
    w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) * 2 + 1
    w = w * 0x9E3779B1
    return torch.stack([(x * w).sum(), x.sum(), torch.tensor(x.numel(), device=x.device)]).cpu()


def _anytime_digest(net: Any, opt: Any, ema: Any) -> str:
    from tests.exactness import _rt

    def walk(obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return (str(obj.dtype), tuple(obj.shape), _fingerprint(obj))
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        return obj

    return _rt._hex(walk({"model": _rt.module_state(net), "optimizer": opt.state_dict(),
                          "ema": _rt.module_state(ema)}))


def _w_anytime() -> None:
    """``--phase ref``: the uninterrupted run's digest after every step. ``trial``: the hook, a preemption from
    another thread inside iteration ``--at`` + 1, ``--frac`` of a step into it (the daemon's intake is such a
    thread). ``verify``: resume each store."""
    import threading
    from datetime import timedelta

    import torch

    phase = sys.argv[sys.argv.index("--phase") + 1]
    steps = int(os.environ.get("SG_GPU_CHECK_ANYTIME_STEPS", "60"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    dist = _init_dist() if "RANK" in os.environ else None
    dev = _dev()
    from spotguard.hook import Hook
    from spotguard.hook.exit import Preempted
    from spotguard.logs import configure_logging
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    configure_logging("json", "info")  # what install_preemption_hook sets up; the check reads these events
    if phase == "ref":
        net, opt, ema, step = _anytime_build(dev)
        _sync()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
            print(json.dumps({"ref": i + 1, "d": _anytime_digest(net, opt, ema)}), flush=True)
        print(json.dumps({"ref_s_per_step": (time.perf_counter() - t0) / steps}), flush=True)
    elif phase == "trial":
        storage = sys.argv[sys.argv.index("--storage") + 1]
        at_step, frac = int(sys.argv[sys.argv.index("--at") + 1]), float(sys.argv[sys.argv.index("--frac") + 1])
        net, opt, ema, step = _anytime_build(dev)
        hook = Hook({"model": net, "optimizer": opt, "ema": ema}, storage, signals=False, intake=False)
        hook.resume()
        done = [0]
        t_loop = [0.0]

        def fire() -> None:
            # a moment inside iteration at_step + 1 as the host sees it (the GPU runs behind, kernels queued)
            while done[0] < at_step:
                time.sleep(0.0005)
            time.sleep(frac * (time.perf_counter() - t_loop[0]) / max(1, done[0]))
            at = done[0]
            now = utcnow()
            hook.notify(Notice(id=f"gpu-anytime-{at_step}-{frac}", source="drill", kind="preemption",
                               deadline=now + timedelta(seconds=30), received_at=now))
            print(json.dumps({"notified_after_steps": at}), flush=True)

        threading.Thread(target=fire, daemon=True).start()
        t_loop[0] = time.perf_counter()
        try:
            for i in range(steps):
                step(i)
                done[0] = i + 1
            _sync()
            print(json.dumps({"error": "no Preempted by the end of the loop"}), flush=True)
        except Preempted as exc:
            print(json.dumps({"preempted": True, "committed": exc.committed, "code": exc.code, "step": exc.step}),
                  flush=True)
    else:  # verify: every trial's store, resumed into a fresh model the way a restarted job does
        for store in sys.argv[sys.argv.index("--stores") + 1].split(","):
            net, opt, ema, _step = _anytime_build(dev, seed=1)  # other initial weights: all must come from storage
            hook = Hook({"model": net, "optimizer": opt, "ema": ema}, store, signals=False, intake=False)
            start = hook.resume()
            print(json.dumps({"store": store, "resumed": start, "d": _anytime_digest(net, opt, ema)}), flush=True)
            hook.close()
    if dist is not None:
        dist.destroy_process_group()


WORKERS: dict[str, Callable[[], None]] = {"rng": _w_rng, "staging": _w_staging, "commit": _w_commit,
                                          "nccl": _w_nccl, "overhead": _w_overhead, "anytime": _w_anytime}


# ---------------------------------------------------------------------------------------------------
# the orchestrator (runs each check as a child with its own budget)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One thread in the CPU dry run: MKL/oneDNN with several threads on a loaded machine need not be
    # bitwise reproducible run to run, which the rng check's reference comparison depends on.
    threads = "1" if _device_kind() == "cpu" else "4"
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "SPOTGUARD_LOG_LEVEL": "info",
           "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra or {})
    return env


def _run(argv: list[str], budget: float, env: dict[str, str] | None = None,
         torchrun_procs: int = 0) -> tuple[int | None, str, str, float]:
    """Run a child (``torchrun`` job when ``torchrun_procs``); (rc or None on timeout, stdout, stderr, secs)."""
    if torchrun_procs:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(torchrun_procs), "-m", "benchmarks.gpu_check", *argv]
    else:
        argv = [sys.executable, "-m", "benchmarks.gpu_check", *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env or _env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=budget)
        return proc.returncode, out, err, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)  # the whole job: torchrun and its workers
        out, err = proc.communicate()
        return None, out, err, time.monotonic() - t0


def _result_line(out: str) -> dict[str, Any] | None:
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    return None


def _log_events(err: str) -> dict[str, dict[str, Any]]:
    """The hook's timeline events (JSON log lines on stderr), last of each name."""
    events: dict[str, dict[str, Any]] = {}
    for line in err.splitlines():
        m = re.search(r"\{.*\}", line)
        if not m:
            continue
        try:
            rec = json.loads(m.group(0))
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            events[rec["event"]] = rec
    return events


def _failure(rc: int | None, out: str, err: str, secs: float, budget: float) -> dict[str, Any]:
    what = f"timed out after {budget:.0f} s" if rc is None else f"exit code {rc}"
    return {"pass": False, "error": what, "seconds": round(secs, 1),
            "stdout_tail": out[-1500:], "stderr_tail": err[-2500:]}


def check_rng(budget: float) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="sg-gpu-rng-")
    t_end = time.monotonic() + budget
    rc1, out1, err1, s1 = _run(["--worker", "rng", "--phase", "pre", "--storage", store], budget, torchrun_procs=1)
    # rc1: torchrun reports the worker's 143 as its own failure; the run is judged by its lines below
    rc2, out2, err2, s2 = _run(["--worker", "rng", "--phase", "resume", "--storage", store],
                               max(10.0, t_end - time.monotonic()), torchrun_procs=1)
    lines = [json.loads(x) for x in (out1 + "\n" + out2).splitlines() if x.startswith("{")]
    ref = {d["ref"]: d["hex"] for d in lines if "ref" in d}
    pre = [json.loads(x) for x in out1.splitlines() if x.startswith('{"step"')]
    post = [json.loads(x) for x in out2.splitlines() if x.startswith('{"step"')]
    flags = [d["flags"] for d in lines if "flags" in d]
    if not ref or not post:
        return _failure(rc2, out1 + out2, err1 + err2, s1 + s2, budget)
    mismatched = [d["step"] for d in pre + post if ref.get(d["step"]) != d["hex"]]
    resumed_from = post[0]["step"]
    detail: dict[str, Any] = {}
    if mismatched:  # what a failure looks like, for the next session to read without a rerun
        detail = {"pre_run": pre, "resumed_run": post, "reference": ref, "stderr_tail": (err1 + err2)[-2500:]}
    return {**detail, "reference_steps": len(ref), "preempted_run_steps": len(pre), "resumed_from": resumed_from,
            "resumed_steps": len(post), "mismatched_steps": mismatched, "flags_seen": flags,
            "threshold": "every resumed loss bitwise equal to the uninterrupted run's; resumed_from > 0",
            "pass": not mismatched and resumed_from > 0 and post[-1]["step"] == max(ref),
            "seconds": round(s1 + s2, 1)}


def check_staging(budget: float) -> dict[str, Any]:
    rc, out, err, secs = _run(["--worker", "staging"], budget)
    res = _result_line(out)
    if res is None:
        return _failure(rc, out, err, secs, budget)
    return {**res, "seconds": round(secs, 1)}


def _commit(budget: float, storage: str, extra_env: dict[str, str]) -> dict[str, Any]:
    rc, out, err, secs = _run(["--worker", "commit", "--storage", storage], budget,
                              env=_env(extra_env), torchrun_procs=1)
    t_exit = time.time()
    head = next((json.loads(x) for x in out.splitlines() if x.startswith('{"state_bytes"')), None)
    events = _log_events(err)
    committed, agreed = events.get("checkpoint_committed"), events.get("agreed")
    if head is None or committed is None:
        return _failure(rc, out, err, secs, budget)
    to_commit = float((agreed or {}).get("seconds_since_notice", 0.0)) + float(committed.get("seconds", 0.0))
    res: dict[str, Any] = {
        "state_gib": round(head["state_bytes"] / GiB, 3), "notice_to_committed_s": round(to_commit, 3),
        "committed_gibps": round(head["state_bytes"] / GiB / max(to_commit, 1e-9), 2),
        "notice_to_exit_s": (events.get("exit") or {}).get("seconds_since_notice"),
        "notice_to_process_end_s": round(t_exit - head["notify_wall"], 3),
        "teardown": {k: (events.get("teardown") or {}).get(k) for k in ("method", "seconds")},
        "uri": committed.get("uri"), "seconds": round(secs, 1),
    }
    if "torch_save_s" in head:
        res["torch_save_s"] = head["torch_save_s"]
    return res


def check_commit(budget: float) -> dict[str, Any]:
    """Local disk and the S3 sink, same state size, and the torch.save baseline (once, in the local job)."""
    half = budget / 2
    local = _commit(half, tempfile.mkdtemp(prefix="sg-gpu-commit-"), {"SG_GPU_CHECK_TORCH_SAVE": "1"})
    port = free_port()
    from benchmarks.s3sink import spawn

    sink = spawn(port, str(REPO), _env())
    try:
        s3env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "b",
                 "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-east-1", "SPOTGUARD_S3_SIGN_PAYLOAD": "0"}
        s3 = _commit(half, "s3://bench/gpu-check", s3env)
    finally:
        sink.kill()
        sink.wait()
    base = local.get("torch_save_s")
    for r in (local, s3):
        if base and "notice_to_committed_s" in r:
            r["vs_torch_save"] = round(r["notice_to_committed_s"] / base, 3)
            r["threshold"] = "notice->committed <= 1.25 x rank-0 torch.save of the same state (first guess)"
            r["pass"] = r["vs_torch_save"] <= 1.25
    return {"local": local, "s3_sink": s3, "torch_save_s": base,
            "pass": bool(local.get("pass")) and bool(s3.get("pass"))}


def _nccl(budget: float, procs: int) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="sg-gpu-nccl-")
    rc, out, err, secs = _run(["--worker", "nccl", "--storage", store], budget, torchrun_procs=procs)
    res = _result_line(out)
    events = _log_events(err)
    if res is None:
        fail = _failure(rc, out, err, secs, budget)
        if procs > 1:
            dup = re.search(r"(Duplicate GPU detected[^\n]*|invalid usage[^\n]*)", err)
            fail["nccl_allows_shared_gpu"] = False if dup else None
            fail["note"] = dup.group(0) if dup else "see stderr_tail"
        return fail
    res["job_wall_s"] = round(secs, 1)  # torchrun start, CUDA init, checks, exit
    res["hook_teardown"] = {k: (events.get("teardown") or {}).get(k) for k in ("method", "seconds")}
    if procs > 1 and res.get("backend") == "nccl":
        res["nccl_allows_shared_gpu"] = True
    return res


def check_nccl(budget: float) -> dict[str, Any]:
    one = _nccl(budget * 0.55, 1)
    two = _nccl(budget * 0.45, 2)
    # 2 processes on one GPU is informational: NCCL may refuse it by design (then it says so)
    return {"one_process": one, "two_processes_one_gpu": two, "pass": bool(one.get("pass"))}


def check_overhead(budget: float) -> dict[str, Any]:
    rc, out, err, secs = _run(["--worker", "overhead"], budget, torchrun_procs=1)
    res = _result_line(out)
    if res is None:
        return _failure(rc, out, err, secs, budget)
    return {**res, "seconds": round(secs, 1)}


def check_anytime(budget: float) -> dict[str, Any]:
    """Notices at random moments while CUDA kernels are queued: every committed state equals the reference's."""
    import random

    t_end = time.monotonic() + budget
    lines = lambda out: [json.loads(x) for x in out.splitlines() if x.startswith("{")]  # noqa: E731
    refs: dict[str, dict[int, str]] = {}
    per_step = 0.0
    modes = ["plain", "dist"]
    ref_runs = _side_by_side(lambda mode: _run(["--worker", "anytime", "--phase", "ref"],
                                               max(10.0, t_end - time.monotonic()),
                                               torchrun_procs=1 if mode == "dist" else 0), modes)
    for mode, (rc, out, err, secs) in zip(modes, ref_runs):
        got = lines(out)
        refs[mode] = {d["ref"]: d["d"] for d in got if "ref" in d}
        per_step = next((d["ref_s_per_step"] for d in got if "ref_s_per_step" in d), per_step)
        if not refs[mode]:
            return {**_failure(rc, out, err, secs, budget), "phase": f"ref {mode}"}
    same_ref = refs["plain"] == refs["dist"]
    distinct = all(len(set(r.values())) == len(r) for r in refs.values())  # the digest sees every step's change
    rnd = random.Random(int(os.environ.get("SG_GPU_CHECK_SEED", "7")))
    steps = len(refs["plain"])
    trials: list[dict[str, Any]] = []
    n = int(os.environ.get("SG_GPU_CHECK_ANYTIME_TRIALS", "6"))
    plan: list[tuple[str, str, int, float]] = []
    for k in range(n):
        plan.append((("plain", "dist")[k % 2], tempfile.mkdtemp(prefix=f"sg-gpu-any{k}-"),
                     rnd.randrange(3, steps - 20), round(rnd.random(), 3)))

    def trial(p: tuple[str, str, int, float]) -> tuple[int | None, str, str, float] | None:
        mode, store, at_step, frac = p
        if time.monotonic() > t_end - 30:
            return None
        return _run(["--worker", "anytime", "--phase", "trial", "--storage", store, "--at", str(at_step), "--frac",
                     str(frac)], min(60.0, t_end - time.monotonic()), torchrun_procs=1 if mode == "dist" else 0)

    for (mode, store, at_step, frac), ran in zip(plan, _side_by_side(trial, plan)):
        if ran is None:
            break
        rc, out, err, secs = ran
        got = {k2: v for d in lines(out) for k2, v in d.items()}
        ev = _log_events(err)
        trials.append({"mode": mode, "at_step": at_step, "frac": frac, "rc": rc, "store": store,
                       "notified_after_steps": got.get("notified_after_steps"), "committed": got.get("committed"),
                       "code": got.get("code"), "error": got.get("error"),
                       "notice_to_committed_s": (ev.get("checkpoint_committed") or {}).get("seconds"),
                       "stderr_tail": err[-800:] if got.get("committed") is not True else None})
    stores = [t["store"] for t in trials]
    rc, out, err, secs = _run(["--worker", "anytime", "--phase", "verify", "--stores", ",".join(stores)],
                              max(15.0, t_end - time.monotonic()))
    resumed = {d["store"]: d for d in lines(out) if "store" in d}
    wrong = 0
    for t in trials:
        r = resumed.get(t["store"], {})
        t["resumed"] = r.get("resumed")
        ref = refs[t["mode"]]
        t["exact"] = bool(r) and (r["resumed"] == 0 or ref.get(r["resumed"]) == r["d"])
        at = t["notified_after_steps"]
        t["lost_steps"] = (at - r["resumed"]) if (at is not None and r.get("resumed") is not None) else None
        ok = t["exact"] and t["committed"] is True and (t["lost_steps"] is not None and t["lost_steps"] <= 1)
        wrong += 0 if ok else 1
        t["ok"] = ok
        if ok:
            t.pop("stderr_tail", None)
    res = {"trials": trials, "reference_steps": steps, "ref_s_per_step": round(per_step, 4),
           "plain_and_dist_references_equal": same_ref, "reference_digests_distinct": distinct, "verify_rc": rc,
           "threshold": "every notice committed; every resumed state bitwise the reference's at its step; "
                        "at most one step lost", "trials_run": len(trials),
           "pass": len(trials) >= min(n, 4) and wrong == 0 and distinct}
    if rc != 0:
        res["verify_stderr_tail"] = err[-2000:]
    return res


def check_torchft(budget: float) -> dict[str, Any]:
    """One torchft replica group on torchft's NCCL process group: every step commits (the leave vote rides the
    group's device), a notice makes the whole job leave, the checkpoint holds the scheduler's step, resume exact."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return {"pass": False, "error": f"torchft not importable ({exc}): carry its wheels (make gpu-wheels)"}
    from spotguard.storage import open_storage
    from spotguard.storage.commit import newest_committed
    from spotguard.torchft.engine import lighthouse_args
    from spotguard.torchft.launch import start_lighthouse
    from spotguard.torchft.worker import LR, lr_factor

    t_end = time.monotonic() + budget
    store = tempfile.mkdtemp(prefix="sg-gpu-ft-")
    device = "cuda" if _device_kind() == "cuda" else "cpu"
    steps, notify_at = 12, 5
    lh = start_lighthouse(lighthouse_args(groups=1, step_seconds=0.1))
    runs: list[dict[str, Any]] = []
    try:
        for extra in (["--notify-at", str(notify_at)], []):
            argv = [sys.executable, "-m", "spotguard.torchft.worker", "--replica-id", "g0", "--lighthouse", lh.addr,
                    "--storage", store, "--steps", str(steps), "--step-time", "0.02", "--device", device, *extra]
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=_env(),
                                      timeout=max(10.0, (t_end - time.monotonic()) * (0.6 if extra else 1.0)))
                rc, out, err = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
            lines = []
            for x in out.splitlines():
                try:
                    lines.append(json.loads(x))
                except ValueError:
                    pass
            runs.append({"rc": rc, "lines": lines, "tail": (out[-1500:], err[-2500:])})
    finally:
        lh.stop()
    pre, post = runs
    steps_of = lambda r: [e for e in r["lines"] if e.get("event") == "replica_step"]  # noqa: E731
    exit_ev = next((e for e in pre["lines"] if e.get("event") == "replica_exit"), None)
    started = next((e for e in post["lines"] if e.get("event") == "replica_started"), None)
    info = newest_committed(open_storage(store))
    uncommitted = [e["step"] for r in runs for e in steps_of(r) if not e.get("committed")]
    lr_wrong = [(e["step"], e["lr"]) for r in runs for e in steps_of(r)
                if e.get("committed") and e["lr"] != LR * lr_factor(e["step"] - 1)]
    post_steps = [e["step"] for e in steps_of(post) if e.get("committed")]
    res: dict[str, Any] = {
        "device": device, "backend": "torchft ProcessGroupNCCL" if device == "cuda" else "torchft ProcessGroupGloo",
        "preempted_rc": pre["rc"], "exit_step": (exit_ev or {}).get("step"),
        "committed_checkpoint_step": info.step if info else None, "uncommitted_steps": uncommitted,
        "resumed_from": (started or {}).get("step"), "resumed_digest_equal": bool(
            started and exit_ev and started.get("digest") == exit_ev.get("digest")),
        "resumed_steps": post_steps, "resumed_rc": post["rc"], "lr_off_schedule": lr_wrong,
        "threshold": "every step committed; exit 143 with a committed checkpoint at the exit step; resume "
                     "bitwise (digest) and every step's learning rate on the uninterrupted schedule",
    }
    res["pass"] = bool(pre["rc"] == 143 and exit_ev and info and info.step == exit_ev["step"]
                       and not uncommitted and res["resumed_digest_equal"] and post["rc"] == 0 and not lr_wrong
                       and post_steps == list(range(info.step + 1, steps + 1)))
    if not res["pass"]:
        res["tails"] = {"preempted": pre["tail"], "resumed": post["tail"]}
    return res


#: name -> (check, budget seconds); the budgets add up to TOTAL_BUDGET_S
CHECKS: dict[str, tuple[Callable[[float], dict[str, Any]], float]] = {
    "anytime": (check_anytime, 140),
    "torchft": (check_torchft, 60),
    "staging": (check_staging, 35),
    "rng": (check_rng, 60),
    "nccl": (check_nccl, 60),
    "overhead": (check_overhead, 45),
    "commit": (check_commit, 120),
}


def _write(summary: dict[str, Any]) -> None:
    text = json.dumps(summary, indent=2, default=str)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "gpu_check.json").write_text(text + "\n")
    print(text, flush=True)


def _environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info.update({"device": torch.cuda.get_device_name(0), "devices": torch.cuda.device_count(),
                     "cuda": torch.version.cuda})
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001 - informational only
            info["nccl"] = f"unknown ({type(exc).__name__})"
    try:
        import spotguard  # noqa: F401 - its dependencies (structlog, crc32c, boto3) must be importable
        info["spotguard_importable"] = True
    except ImportError as exc:
        info["spotguard_importable"] = False
        info["spotguard_import_error"] = f"{exc}: carry the wheels (make gpu-wheels, docs/performance.md)"
    return info


def _side_by_side(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]``; in the CPU dry run (which measures nothing) side by side, each item's children
    at once; on the GPU one at a time, so that each one's figures are its own."""
    if _device_kind() != "cpu" or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def _one_check(name: str) -> dict[str, Any]:
    """Run check ``name`` within its budget; an exception is recorded as its failure (never hides the others)."""
    fn, budget = CHECKS[name]
    budget = float(os.environ.get(f"SG_GPU_CHECK_BUDGET_{name.upper()}", budget))
    t0 = time.monotonic()
    print(f"gpu-check: {name} (budget {budget:.0f} s) ...", file=sys.stderr, flush=True)
    try:
        res = fn(budget)
    except Exception as exc:  # noqa: BLE001 - one check's failure must not hide the others
        res = {"pass": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    res.setdefault("wall_s", round(time.monotonic() - t0, 1))
    print(f"gpu-check: {name}: {'PASS' if res.get('pass') else 'FAIL'} ({res['wall_s']} s)", file=sys.stderr, flush=True)
    return res


def orchestrate() -> int:
    kind = _device_kind()
    if kind == "notorch":
        why = (f"{sys.executable} cannot import torch: run it with a Python that has torch, "
               "e.g. make gpu-check GPU_PY=.venv/bin/python")
        print(f"SKIP gpu-check: {why}", flush=True)
        _write({"skipped": why, "pass": True})
        return 0
    if kind == "none":
        summary = {"skipped": "no CUDA device: gpu-check needs a GPU (set SG_GPU_CHECK_DEVICE=cpu for a dry run "
                              "of the script on the CPU)", "pass": True}
        print("SKIP gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False)", flush=True)
        _write(summary)
        return 0
    only = [x for x in os.environ.get("SG_GPU_CHECK_ONLY", "").split(",") if x]
    try:
        environment = _environment()
    except Exception as exc:  # noqa: BLE001 - never let the description stop the checks
        environment = {"error": f"{type(exc).__name__}: {exc}"}
    summary: dict[str, Any] = {"mode": "gpu" if kind == "cuda" else "cpu-dry-run (no GPU figures)",
                               "environment": environment, "checks": {}}
    t_all = time.monotonic()
    names = [n for n in CHECKS if not only or n in only]
    summary["checks"] = dict(zip(names, _side_by_side(_one_check, names)))
    summary["wall_s"] = round(time.monotonic() - t_all, 1)
    summary["pass"] = all(bool(r.get("pass")) for r in summary["checks"].values())
    _write(summary)
    return 0 if summary["pass"] else 1


def main() -> None:
    if "--worker" in sys.argv:
        WORKERS[sys.argv[sys.argv.index("--worker") + 1]]()
        return
    sys.exit(orchestrate())


if __name__ == "__main__":
    main()
