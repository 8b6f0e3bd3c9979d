"""A small, deterministic DDP training job for ``torchrun --nproc-per-node 2`` (gloo, CPU).

Used by ``make demo``, the hook's tests and the overhead benchmark. The only
spotguard lines are ``install_preemption_hook(...)`` and ``hook.resume()``; the
loop itself is the common ``opt.step(); sched.step()`` with dropout drawing from
the global RNG, so an interrupted-and-resumed run must end bitwise identical to
an uninterrupted one (``--no-hook`` runs the same code path without spotguard).

Run::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --steps 40 --storage /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class SyntheticLoader:
    """A stateful, per-rank loader: batch ``pos`` is a pure function of (seed, rank, pos)."""

    def __init__(self, seed: int, rank: int, batch: int = 16, dim: int = 32) -> None:
        self.seed, self.rank, self.batch, self.dim = seed, rank, batch, dim
        self.pos = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.pos)
        self.pos += 1
        x = torch.randn(self.batch, self.dim, generator=g)
        y = x[:, :4].sum(dim=1, keepdim=True).tanh() + 0.1 * torch.randn(self.batch, 1, generator=g)
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])


def build(args: argparse.Namespace, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, 1),
    )
    if args.optim == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    return net, opt, sched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--storage", default=None, help="checkpoint URI (default: $SPOTGUARD_STORAGE or ./checkpoints)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (simulated work)")
    p.add_argument("--out", default=None, help="rank 0 writes final model+optimizer state here (torch.save)")
    p.add_argument("--no-hook", action="store_true", help="uninterrupted reference run without spotguard")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--optim", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--keep", type=int, default=None)
    args = p.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1)

    net, opt, sched = build(args, rank)
    model: torch.nn.Module = DDP(net) if distributed else net
    loader = SyntheticLoader(args.seed, rank)
    # Per-rank RNG streams (dropout differs per rank; spotguard must keep them apart).
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    start = 0
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook({"model": model, "optimizer": opt, "scheduler": sched, "loader": loader},
                                       storage=args.storage, keep=args.keep)
        start = hook.resume()

    model.train()
    for step in range(start, args.steps):
        x, y = next(loader)
        opt.zero_grad(set_to_none=True)
        noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))  # python + numpy RNG in the math
        loss = F.mse_loss(model(x) * noise, y)
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 6)}), flush=True)
        if args.step_time > 0:
            time.sleep(args.step_time)

    if args.out and rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "steps": args.steps}, args.out)
    if distributed:
        # Leave together: with gloo on torch 2.13 a rank that tears down while its
        # peer still holds the connection occasionally aborts in a gloo thread.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
