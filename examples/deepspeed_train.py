"""DeepSpeed + spotguard: a small deterministic ZeRO job (gloo, CPU) for ``torchrun --nproc-per-node 2``.

The spotguard lines, after ``deepspeed.initialize(...)``::

    hook = install_preemption_hook(engine, storage=...)
    hook.add_state("data", data)     # anything with state_dict/load_state_dict, saved per rank
    start = hook.resume()

No loop change: the hook decides after each ``engine.step()`` that ends an
accumulation. On a notice (daemon, SIGTERM, SIGUSR1) every rank stops at the same
step, ``engine.save_checkpoint`` is streamed into ``<storage>/step-N/`` and
committed, and the process exits with ``spotguard.Preempted`` (143).

Run (DeepSpeed on CPU: ``DS_ACCELERATOR=cpu``; its shared-memory comm op is built
once, into ``$TORCH_EXTENSIONS_DIR``)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/deepspeed_train.py --zero 2 \\
        --steps 30 --storage /tmp/ckpt-ds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchrun_train import SyntheticLoader  # noqa: E402 - the same stateful per-rank batches (examples/ on sys.path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--storage", default=None)
    p.add_argument("--every", default=None, help="periodic checkpoints, e.g. 15m (default: none)")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--backward-time", type=float, default=0.0, help="seconds each backward takes (a slow iteration)")
    p.add_argument("--out", default=None, help="rank 0 writes the final model state here")
    p.add_argument("--no-hook", action="store_true", help="uninterrupted reference run without spotguard")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--zero", type=int, default=2, help="ZeRO stage (0-3)")
    p.add_argument("--offload", action="store_true", help="offload the optimizer to CPU (torch AdamW)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches a step; --step-time is per micro-batch")
    args = p.parse_args(argv)

    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, 1),
    )
    zero: dict[str, Any] = {"stage": args.zero}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": args.grad_accum,
        "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 1000}},
    }
    engine, _opt, _, _sched = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    # Per-rank RNG streams (dropout differs per rank; spotguard saves each rank's).
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    data = SyntheticLoader(args.seed, rank, batch=8)

    start = 0
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook(engine, storage=args.storage, every=args.every)  # <- the spotguard line
        hook.add_state("data", data)
        start = hook.resume()

    engine.train()
    for step in range(start, args.steps):  # one optimizer step: --grad-accum micro-batches
        for _micro in range(args.grad_accum):
            x, y = next(data)
            noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))  # python + numpy RNG in the math
            out = engine(x)
            if args.backward_time > 0:  # the first thing the backward runs: the whole iteration is slow there
                out.register_hook(lambda g: (time.sleep(args.backward_time), g)[1])
            loss = F.mse_loss(out * noise, y)
            engine.backward(loss)
            engine.step()
            if rank == 0:
                v = loss.item()
                print(json.dumps({"step": step, "loss": v, "hex": v.hex()}), flush=True)
            if args.step_time > 0:
                time.sleep(args.step_time)

    if args.out:
        if args.zero == 3:  # gather the partitioned parameters (collective)
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                sd = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        else:
            sd = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        if rank == 0:
            torch.save({"model": sd, "steps": args.steps}, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
