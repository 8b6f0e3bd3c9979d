"""A 2-rank DDP job for the peer watch's own tests (``tests/hook/test_peers.py``).

``--mode gil``: after step 3, rank 1's training thread holds the GIL for ``--hold`` seconds in one C call
(``usleep`` through ``ctypes.PyDLL``, which keeps the GIL) — a slow-but-alive rank. ``--mode bye``: rank 1
closes its hook after step 3 and stays alive ``--hold`` seconds before the final barrier — a rank that left
the watch on purpose. Either way the job must end 0 unless the hold is longer than the peer timeout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("gil", "bye"), required=True)
    p.add_argument("--hold", type=float, default=1.5)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    from spotguard import install_preemption_hook

    hook = install_preemption_hook({"model": model, "optimizer": opt})
    hook.resume()
    for step in range(args.steps):
        loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 1 and step == 3:
            if args.mode == "gil":
                t0 = time.monotonic()
                ctypes.PyDLL(None).usleep(int(args.hold * 1e6))  # PyDLL: the GIL stays held during the call
                print(json.dumps({"held_gil": round(time.monotonic() - t0, 3), "rank": rank}), flush=True)
            else:
                hook.close()
                time.sleep(args.hold)
                print(json.dumps({"closed_and_slept": args.hold, "rank": rank}), flush=True)
        if args.mode == "bye" and step == 3:
            break  # both ranks stop training; rank 0 waits in the barrier below while rank 1 sleeps
        time.sleep(0.05)
    if args.mode == "bye" and rank == 0:
        print(json.dumps({"waiting_in_barrier": True, "rank": rank}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
