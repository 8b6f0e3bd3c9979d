"""Worker for test_store_host_exit: rank 0 (the c10d store's host) exits while rank 1 is finalizing.

Rank 1 keeps a module global whose ``__del__`` runs during interpreter
finalization (after ``atexit``, when daemon threads can no longer take the GIL):
it writes a flag file and sleeps. Rank 0 waits for that flag, then exits; its
store server goes with it, so a thread of rank 1 still parked in ``store.wait``
returns right then.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spotguard import install_preemption_hook


class _SlowAtFinalization:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __del__(self) -> None:
        self.flag.write_text("finalizing")
        time.sleep(3.0)


def main() -> int:
    storage, flag = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = install_preemption_hook({"model": model, "optimizer": opt}, storage=storage)
    hook.resume()
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print('{"trained": true, "rank": %d, "background": %s}' % (rank, str(bool(hook._bg_on)).lower()), flush=True)
    if rank == 0:
        end = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < end:
            time.sleep(0.01)
        os._exit(0)  # the store host leaves while rank 1 finalizes
    global _keep
    _keep = _SlowAtFinalization(flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
