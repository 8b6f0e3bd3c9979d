"""The job of the vanished-node runs (``tests/chaos/vanish.py``): DDP on gloo, one JSON line per step per rank.

Rank 0 hands its hook a ``rebalance`` notice after step ``--checkpoint-at``: an ordinary checkpoint is
committed and training goes on, so every freeze happens with a committed checkpoint already in storage
(the one the job must resume from when nothing newer was committed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--checkpoint-at", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    hook = install_preemption_hook({"model": model, "optimizer": opt})
    start = hook.resume()
    print(json.dumps({"resume": start, "rank": rank, "world": dist.get_world_size(), "pid": os.getpid()}), flush=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(start, args.steps):
        x = torch.randn(64, 32, generator=g)
        loss = F.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()  # the user's DDP all-reduce
        opt.step()
        print(json.dumps({"step": step, "rank": rank, "loss": round(loss.item(), 6)}), flush=True)
        if rank == 0 and step == args.checkpoint_at and start == 0:
            now = utcnow()
            hook.notify(Notice(id=f"rebalance-{step}", source="drill", kind="rebalance",
                               deadline=now + timedelta(seconds=120), received_at=now, detail="test"))
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
