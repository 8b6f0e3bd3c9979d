"""A user's first script, with the user's mistakes as flags, for ``torchrun --nproc-per-node 2`` (gloo, CPU).

- ``--install-before-init``: ``install_preemption_hook`` before ``init_process_group``.
- ``--no-resume``: ``hook.resume()`` forgotten.
- ``--notify-at K``: at the start of iteration K every rank hands the hook the same
  preemption notice (``hook.notify``), so two runs stop at the same step.

Prints ``{"step": i, "loss": ...}`` on rank 0 and ``{"install_error": ...}`` on every rank
whose install raised.
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
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--storage", required=True)
    p.add_argument("--install-before-init", action="store_true")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--notify-at", type=int, default=-1)
    p.add_argument("--every", default=None)
    args = p.parse_args()

    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = {"model": net, "optimizer": opt}
    if args.install_before_init:
        try:
            install_preemption_hook(state, storage=args.storage)
        except Exception as exc:  # noqa: BLE001 - the mistake's answer is what the test reads
            print(json.dumps({"install_error": f"{type(exc).__name__}: {exc}", "rank": os.environ.get("RANK")}),
                  flush=True)
            return 3
        print(json.dumps({"installed_before_init": True, "rank": os.environ.get("RANK")}), flush=True)
        return 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(net)
    state["model"] = model
    try:
        hook = install_preemption_hook(state, storage=args.storage, every=args.every)
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"install_error": f"{type(exc).__name__}: {exc}", "rank": rank}), flush=True)
        dist.destroy_process_group()
        return 3
    start = 0 if args.no_resume else hook.resume()
    for step in range(start, args.steps):
        if step == args.notify_at:
            now = utcnow()
            hook.notify(Notice(id=f"drill-test-{step}", source="drill", kind="preemption",
                               deadline=now + timedelta(seconds=30), received_at=now, detail="test"))
            # The ranks agree off the training thread within milliseconds; give them that before this
            # iteration's optimizer step, so that every run stops at the same step (4) whatever the timing.
            time.sleep(0.5)
        g = torch.Generator().manual_seed(step * 2 + rank)
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 6)}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
