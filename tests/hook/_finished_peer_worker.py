"""One rank of ``test_teardown_race.py::test_notice_after_the_peers_finished``: a notice in this rank's last
iteration, after the other rank already left its loop and called ``destroy_process_group()``.

DDP lets rank 0 finish once the last all-reduce is done while rank 1 still runs its last optimizer step.
Rank 0: trains, ``destroy_process_group()``, writes ``r0-destroyed``, stays alive until rank 1 is done.
Rank 1: in its last iteration, after ``opt.step()``, waits for ``r0-destroyed``, gets a termination notice,
waits for the background round to end, then finishes its loop and tears down. Both print a JSON line.

usage: python _finished_peer_worker.py RANK DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4


def await_file(path: Path, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> int:
    rank, d = int(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    from spotguard.hook import Hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    dist.init_process_group("gloo", store=dist.FileStore(str(d / "store"), 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = Hook({"model": model, "optimizer": opt}, str(d / "ck"), signals=False, intake=False)
    h.resume()
    assert h._bg is not None and h._peers is not None, "needs the background agreement and the peer watch"
    for i in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if rank == 1 and i == STEPS - 1:  # after the last all-reduce: rank 0 may be gone from its loop
            await_file(d / "r0-destroyed", "rank 0's destroy_process_group()")
            gen = h._bg.gen
            now = utcnow()
            h.notify(Notice(id="late-in-last-iteration", source="drill", kind="termination",
                            deadline=now + timedelta(seconds=30), received_at=now))
            end = time.monotonic() + 20.0
            while (h._bg.gen <= gen or h._bg.busy.is_set()) and time.monotonic() < end:
                time.sleep(0.01)  # the round's own outcome: over (or this process left with its code)
    dist.destroy_process_group()
    if rank == 0:
        (d / "r0-destroyed").touch()
        await_file(d / "r1-done", "rank 1's end")
    else:
        (d / "r1-done").touch()
    print(json.dumps({"rank": rank, "steps": STEPS, "ok": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
