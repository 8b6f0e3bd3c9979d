"""One rank of the teardown stress (``test_teardown_race.py``): many short jobs in one process, then exit.

Each round: ``init_process_group`` (gloo, a fresh FileStore), DDP model, the hook,
a few steps with no step time, optionally ``barrier()``, then the user's
``destroy_process_group()`` — while the hook's last flag reduction was launched
at the final step's post-hook and may still be in flight. The process exits 0
only if every round and the interpreter exit went through.

usage: python _teardown_worker.py RANK ROUNDS DIR [--no-barrier] [--late-notice]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def gloo_worker_threads() -> int:
    """gloo's per-group worker threads ("pt_gloo_runloop") alive in this process."""
    names = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")


def main() -> int:
    rank, rounds, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    barrier = "--no-barrier" not in sys.argv
    torch.set_num_threads(1)
    from spotguard.hook import Hook
    from spotguard.hook.dist import group_alive

    hooks = []
    for i in range(rounds):
        store = dist.FileStore(os.path.join(d, f"store{i}"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        torch.manual_seed(i)
        model = DDP(torch.nn.Linear(8, 1))  # its first broadcast starts the default group's workers
        threads_without_hook = gloo_worker_threads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = Hook({"model": model, "optimizer": opt}, os.path.join(d, f"ck{i}"), signals=False, intake=False)
        h.resume()
        for _ in range(3 + i % 3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        group = h._group
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
        assert h._life.torn_down and not group_alive(group), "the hook did not quiesce before destroy"
        del group
        # The hook's own group must be gone with its worker threads, not left for interpreter
        # shutdown (where a worker still freeing a finished work aborts the process with -6).
        assert gloo_worker_threads() == threads_without_hook, (gloo_worker_threads(), threads_without_hook)
        hooks.append(h)
        if i < rounds - 1:
            h.close()
    if "--late-notice" in sys.argv:  # after destroy: no collective, logged at exit, exit code kept
        from datetime import timedelta

        from spotguard.notice import Notice
        from spotguard.timefmt import utcnow

        now = utcnow()
        hooks[-1].notify(Notice(id=f"late-{rank}", source="drill", kind="preemption",
                                deadline=now + timedelta(seconds=30), received_at=now))
    print(json.dumps({"rank": rank, "rounds": rounds, "ok": True}), flush=True)
    return 0  # the last hook's atexit runs during interpreter exit


if __name__ == "__main__":
    sys.exit(main())
