"""Accelerate + spotguard: a small deterministic DDP job (gloo, CPU) for ``torchrun --nproc-per-node 2``.

The spotguard lines, after ``accelerator.prepare(...)``::

    hook = install_preemption_hook(accelerator, storage=...)
    start = hook.resume()

No loop change: the hook decides at each ``optimizer.step()``. On a notice
(daemon, SIGTERM, SIGUSR1) every rank stops at the same step,
``accelerator.save_state`` is committed as ``<storage>/step-N/`` and the process
exits with ``spotguard.Preempted`` (143). ``hook.resume()`` loads it with
``accelerator.load_state`` and returns the step to continue from.

Run::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --steps 30 --storage /tmp/ckpt-acc
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator


def batch(seed: int, rank: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``pos`` of this rank: a pure function of (seed, rank, pos), so resuming at ``start`` is exact."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + pos)
    x = torch.randn(16, 32, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).tanh() + 0.1 * torch.randn(16, 1, generator=g)
    return x, y


def _zero(stage: int, offload: bool) -> dict[str, Any]:
    """ZeRO section: ZeRO-3 gathers the 16-bit weights at save (the checkpoint then holds them whole too)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return zero


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--storage", default=None)
    p.add_argument("--every", default=None, help="safety-net checkpoints, e.g. 15m (default: none)")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--compute-time", type=float, default=0.0,
                   help="seconds slept inside each micro-batch, between backward and optimizer.step() (a long step)")
    p.add_argument("--out", default=None, help="rank 0 writes the final model+optimizer state here")
    p.add_argument("--no-hook", action="store_true", help="uninterrupted reference run without spotguard")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches a step (accelerator.accumulate); "
                   "--step-time is per micro-batch")
    p.add_argument("--deepspeed", type=int, default=None, metavar="STAGE",
                   help="train through Accelerate's DeepSpeedPlugin with this ZeRO stage (DS_ACCELERATOR=cpu)")
    p.add_argument("--offload", action="store_true", help="with --deepspeed: offload the optimizer to CPU")
    p.add_argument("--no-broadcast-buffers", action="store_true",
                   help="DDP(broadcast_buffers=False): each rank keeps its own BatchNorm statistics (--out: rank 1's "
                        "buffers go to OUT.rank1)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    plugin = None
    if args.deepspeed is not None:
        from accelerate import DeepSpeedPlugin

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": args.grad_accum,
            "zero_optimization": _zero(args.deepspeed, args.offload), "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9})
    handlers = []
    if args.no_broadcast_buffers:
        from accelerate.utils import DistributedDataParallelKwargs

        handlers.append(DistributedDataParallelKwargs(broadcast_buffers=False))
    accelerator = Accelerator(cpu=plugin is None, gradient_accumulation_steps=args.grad_accum,
                              deepspeed_plugin=plugin, kwargs_handlers=handlers)
    # torch.distributed's rank: Accelerate 1.15 with a DeepSpeedPlugin on CPU reports process_index 0 on every rank
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else accelerator.process_index
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.BatchNorm1d(args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, 1),
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    model, opt, sched = accelerator.prepare(net, opt, sched)
    # Per-rank RNG streams (dropout differs per rank; spotguard/Accelerate keep them apart).
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    start = 0
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook(accelerator, storage=args.storage, every=args.every)  # <- the spotguard line
        start = hook.resume()

    model.train()
    for step in range(start, args.steps):  # one optimizer step: --grad-accum micro-batches
        for micro in range(args.grad_accum):
            x, y = batch(args.seed, rank, step * args.grad_accum + micro)  # resuming at `start` replays step start
            with accelerator.accumulate(model):  # opt.step()/sched.step() act on the last micro-batch only
                noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))  # python + numpy RNG in the math
                loss = F.mse_loss(model(x) * noise, y)
                accelerator.backward(loss)
                if args.compute_time > 0:
                    time.sleep(args.compute_time)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0:
                v = loss.item()
                print(json.dumps({"step": step, "micro": micro, "loss": v, "hex": v.hex()}), flush=True)
            if args.step_time > 0:
                time.sleep(args.step_time)

    if args.out:
        sd = accelerator.get_state_dict(model)  # ZeRO-3: gathered from every rank's partition (collective)
        if rank == 0:
            torch.save({"model": sd, "optimizer": opt.state_dict(), "steps": args.steps}, args.out)
        elif args.no_broadcast_buffers and rank == 1:
            torch.save(dict(model.named_buffers()), f"{args.out}.rank1")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
