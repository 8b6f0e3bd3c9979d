"""A DDP job with a fixed global batch split over however many ranks it runs on (elastic resume tests).

Dataset: sample ``i`` is a pure function of ``i``; the loader is a ``DataLoader``
on ``spotguard.data.ElasticDistributedSampler`` (``--pass sampler`` hands the
hook the sampler, ``--pass loader`` the DataLoader); AdamW + StepLR. Every rank
appends the sample ids of each completed step to ``<records>/ids-rank<r>.jsonl``;
on resume every rank prints ``{"resume": step, "lr": ..., "last_epoch": ...}``.
``--stop-at S``: rank 0 hands its hook a preemption notice and waits until the hook
has agreed on it (``await_agreement``), so that the checkpoint stands for a known
step: one process, notice at the top of iteration S (before its forward): S;
distributed, notice at the end of step S: S + 1. ``--out``: rank 0 saves the final weights.
Optional ``--fsdp``: the model is ``fully_shard``-ed (FSDP2) instead of DDP-wrapped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from spotguard.data import ElasticDistributedSampler


def await_agreement(hook: Any, timeout: float = 60.0) -> None:
    """Block this (training) thread until the hook's agreement round for the notice just handed over has
    decided its step S (or the hook is leaving).

    Why: the round runs on the hook's agreement thread and stands at the count it finds when it joins
    (core.py, agreement.py). On a loaded machine that thread may be scheduled only a few of this script's
    ~1 ms iterations after ``notify()``; the checkpoint is then exact, but for a later step than the one the
    test chose. Waiting here (the agreement thread notifies ``_steps.cv`` when it sets ``_steps.target``) pins S to the
    count at the notice: while this thread waits, its count cannot move. Under torch.distributed the round's
    gather needs every rank's join, so rank 0's ``_steps.target`` means every rank has joined.
    """
    with hook._steps.cv:
        done = hook._steps.cv.wait_for(lambda: hook._steps.target is not None or hook._life.exit_requested, timeout)
    if not done:
        raise SystemExit(f"the hook did not agree on the notice within {timeout} s")


class Points(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(16, generator=g)
        y = torch.sin(x[:4].sum(dim=0, keepdim=True))
        return i, x, y


class Tally:
    """Per-rank state (declared with ``scope={"tally": "per_rank"}``): steps this rank's lineage trained."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = int(sd["n"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--storage", default=None)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--out", default=None)
    p.add_argument("--records", default=None)
    p.add_argument("--no-hook", action="store_true")
    p.add_argument("--pass", dest="pass_", choices=("sampler", "loader"), default="loader")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (simulated work)")
    args = p.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.set_num_threads(1)
    assert args.global_batch % world == 0 and args.samples % args.global_batch == 0
    per_epoch = args.samples // args.global_batch

    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        model: torch.nn.Module = fully_shard(net) if distributed else net
    else:
        model = DDP(net) if distributed else net
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    sampler = ElasticDistributedSampler(Points(args.samples), seed=11)
    loader = DataLoader(Points(args.samples), batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.workers)

    tally = Tally()
    start = 0
    if not args.no_hook:
        from spotguard import install_preemption_hook
        from spotguard.notice import Notice
        from spotguard.timefmt import utcnow

        data = sampler if args.pass_ == "sampler" else loader
        hook = install_preemption_hook({"model": model, "optimizer": opt, "scheduler": sched, "data": data,
                                        "tally": tally}, storage=args.storage, scope={"tally": "per_rank"})
        start = hook.resume()
        print(json.dumps({"resume": start, "rank": rank, "world": world, "lr": opt.param_groups[0]["lr"],
                          "last_epoch": sched.last_epoch, "sampler": sampler.state_dict(), "tally": tally.n,
                          "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]}),
              flush=True)
    records = open(Path(args.records) / f"ids-rank{rank}.jsonl", "a") if args.records else None

    step = start
    while step < args.steps:
        sampler.set_epoch(step // per_epoch)
        for ids, x, y in loader:
            if step == args.stop_at and rank == 0 and not args.no_hook and not distributed:
                # One process, at the top of iteration `step` (before its forward): the checkpoint stands for
                # the `step` completed iterations, read at this iteration's forward (its anchor).
                hook.notify(Notice(id=f"stop-{step}", source="drill", kind="preemption",
                                   deadline=utcnow() + timedelta(seconds=60), received_at=utcnow()))
                await_agreement(hook)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            tally.n += 1
            if records is not None:
                records.write(json.dumps({"step": step, "world": world, "ids": ids.tolist()}) + "\n")
                records.flush()
            if rank == 0:
                print(json.dumps({"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                                  "last_epoch": sched.last_epoch}), flush=True)
            if step == args.stop_at and rank == 0 and not args.no_hook and distributed:
                # Distributed: agreed off the training thread on the last completed step, S+1 here (the other
                # ranks cannot pass step S+1's backward while rank 0 waits: DDP's all-reduce needs it).
                hook.notify(Notice(id=f"stop-{step}", source="drill", kind="preemption",
                                   deadline=utcnow() + timedelta(seconds=60), received_at=utcnow()))
                await_agreement(hook)
            step += 1
            if args.step_time > 0:
                time.sleep(args.step_time)
            if step >= args.steps:
                break

    if args.fsdp and distributed:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

        full: Any = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        full = net.state_dict()
    if args.out and rank == 0:
        torch.save({"model": full, "lr": opt.param_groups[0]["lr"], "last_epoch": sched.last_epoch}, args.out)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
