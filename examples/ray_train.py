"""Ray Train + spotguard: TorchTrainer with 2 CPU workers, a preemption, and a FailureConfig restart.

Inside ``train_loop_per_worker`` the plain-PyTorch hook is the one line::

    hook = install_preemption_hook({"model": model, "optimizer": opt, "scheduler": sched, "loader": loader},
                                   storage=config["storage"])
    start = hook.resume()

On a notice every worker stops at the same step, the checkpoint is committed to
spotguard storage and reported to Ray (a pointer checkpoint), and the workers
exit with ``Preempted``; Ray counts a worker failure and ``FailureConfig``
restarts the group, whose ``hook.resume()`` continues from the committed step.
Ray runs the loop in a worker thread, so notices come from the spotguard daemon
(its socket) — here, for a self-contained run, ``--preempt-at N`` hands rank 1
alone a synthetic notice with ``hook.notify`` on the first attempt.

Run::

    python examples/ray_train.py --steps 30 --storage /tmp/ckpt-ray --preempt-at 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


class SyntheticLoader:
    """A stateful, per-rank loader: batch ``pos`` is a pure function of (seed, rank, pos)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank, self.pos = seed, rank, 0

    def __iter__(self) -> "SyntheticLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.pos)
        self.pos += 1
        x = torch.randn(16, 32, generator=g)
        return x, x[:, :4].sum(dim=1, keepdim=True).tanh() + 0.1 * torch.randn(16, 1, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    seed = config["seed"]
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    model = ray.train.torch.prepare_model(net)  # DDP over Ray's gloo process group
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    loader = SyntheticLoader(seed, rank)
    torch.manual_seed(seed + 1 + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)

    hook = install_preemption_hook({"model": model, "optimizer": opt, "scheduler": sched, "loader": loader},
                                   storage=config["storage"])  # <- the spotguard line
    start = hook.resume()
    first_attempt = start == 0

    for step in range(start, config["steps"]):
        if first_attempt and rank == 1 and step == config["preempt_at"]:
            hook.notify(Notice(id=f"ray-demo-{step}", source="drill", kind="preemption",
                               deadline=utcnow() + timedelta(seconds=30)))
        x, y = next(loader)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x) * (1.0 + 0.01 * random.random()), y)
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            v = loss.item()
            print(json.dumps({"step": step, "loss": v, "hex": v.hex(), "attempt_start": start}), flush=True)
        if config["step_time"]:
            time.sleep(config["step_time"])
    if rank == 0 and config.get("out"):
        torch.save({"model": net.state_dict(), "steps": config["steps"]}, config["out"])
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--storage", required=True, help="spotguard checkpoint URI (shared by all workers)")
    p.add_argument("--preempt-at", type=int, default=-1, help="rank 1 gets a notice at this step (first attempt)")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--out", default=None, help="rank 0 writes the final model state here")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"steps": args.steps, "storage": args.storage, "preempt_at": args.preempt_at,
                           "step_time": args.step_time, "seed": args.seed, "out": args.out},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="spotguard-ray-demo", storage_path=tempfile.mkdtemp(prefix="ray-results-"),
                             failure_config=FailureConfig(max_failures=2)),
    )
    result = trainer.fit()
    print(json.dumps({"ray_result": True, "error": repr(result.error) if result.error else None,
                      "checkpoint": result.checkpoint.path if result.checkpoint else None}), flush=True)
    ray.shutdown()
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
