"""``examples/torchrun_train.py``'s job with periodic checkpoints (``--every``) and a slow background store.

usage: torchrun --nproc-per-node 2 _periodic_train.py --steps N --storage DIR --every SECONDS
       [--slow SECONDS_PER_ITEM] [--step-time S] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _example():  # -> module
    spec = importlib.util.spec_from_file_location("_sg_example", HERE.parents[1] / "examples" / "torchrun_train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--storage", required=True)
    p.add_argument("--every", type=float, required=True)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--optim", default="sgd")
    args = p.parse_args()
    ex = _example()
    from _slowstore import SlowPeriodicStorage

    from spotguard.hook import Hook
    from spotguard.logs import configure_logging

    configure_logging("json", "info")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    net, opt, sched = ex.build(args, rank)
    model = DDP(net)
    loader = ex.SyntheticLoader(args.seed, rank)
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    hook = Hook({"model": model, "optimizer": opt, "scheduler": sched, "loader": loader},
                SlowPeriodicStorage(args.storage, args.slow), every=args.every)
    start = hook.resume()
    model.train()
    for step in range(start, args.steps):
        x, y = next(loader)
        opt.zero_grad(set_to_none=True)
        noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
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
    dist.barrier()
    dist.destroy_process_group()  # the hook waits for an upload in flight first
    return 0


if __name__ == "__main__":
    sys.exit(main())
