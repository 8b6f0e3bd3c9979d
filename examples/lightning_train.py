"""Lightning + spotguard: a small deterministic DDP job (gloo, CPU) for ``torchrun --nproc-per-node 2``.

The spotguard line is ``hook = install_preemption_hook(trainer, storage=...)``:
it adds a callback and, when a committed checkpoint exists, makes
``trainer.fit`` resume from it (``ckpt_path=hook.latest()`` says the same
explicitly). On a notice (daemon, SIGTERM, SIGUSR1) every rank stops at the
same step, ``step-N/lightning.ckpt`` is committed, and ``trainer.fit`` raises
``spotguard.Preempted`` (exit 143) so the launcher restarts the job.

Run::

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --steps 30 --storage /tmp/ckpt-pl

Batch ``i`` of an epoch is a pure function of (seed, rank, epoch, i), taken from
Lightning's own restored progress counters: with a real dataset use a
``torchdata`` ``StatefulDataLoader`` (see docs/frameworks.md for its prefetch caveat).
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
import torch.nn.functional as F

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name works the same
    import pytorch_lightning as pl  # type: ignore[no-redef]


class Indices:
    """``len(self)`` batches per epoch; the module builds each batch from its index (no state to lose)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor(i) for i in range(self.n))


class Net(pl.LightningModule):
    def __init__(self, seed: int, hidden: int, step_time: float, log_file: str | None) -> None:
        super().__init__()
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, 1),
        )
        self.seed, self.step_time, self.log_file = seed, step_time, log_file
        self.eval_step_time = 0.0

    def batch(self, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        rank = self.trainer.global_rank
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007
                                          + self.current_epoch * 1_009 + batch_idx)
        x = torch.randn(16, 32, generator=g)
        y = x[:, :4].sum(dim=1, keepdim=True).tanh() + 0.1 * torch.randn(16, 1, generator=g)
        return x, y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.batch(batch_idx)
        noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))  # python + numpy RNG in the math
        loss = F.mse_loss(self.net(x) * noise, y)  # dropout draws from torch's RNG
        if self.trainer.global_rank == 0:
            print(json.dumps({"step": self.global_step, "epoch": self.current_epoch, "batch": batch_idx,
                              "loss": loss.item(), "hex": loss.item().hex()}), flush=True)
        if self.step_time > 0:
            time.sleep(self.step_time)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Eval mode, no random draws: how long validation takes never changes the training losses."""
        if self.trainer.global_rank == 0:
            print(json.dumps({"val_batch": batch_idx, "step": self.global_step}), flush=True)
        x, y = self.batch(batch_idx)
        if self.eval_step_time > 0:
            time.sleep(self.eval_step_time)
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None, deepspeed_strategy: Any = None) -> int:
    """``deepspeed_strategy``: the ``DeepSpeedStrategy`` class ``--deepspeed`` builds (default Lightning's own,
    which Lightning runs on CUDA only; the tests pass a CPU subclass: tests/hook/adapters/lightning_ds_train.py)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batches-per-epoch", type=int, default=12)
    p.add_argument("--storage", default=None)
    p.add_argument("--every", default=None, help="safety-net checkpoints, e.g. 15m (default: none)")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--out", default=None, help="rank 0 writes the final model+optimizer state here")
    p.add_argument("--no-hook", action="store_true", help="uninterrupted reference run without spotguard")
    p.add_argument("--explicit-ckpt-path", action="store_true", help="pass ckpt_path=hook.latest() to fit")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches (micro-batches a step)")
    p.add_argument("--deepspeed", type=int, default=None, metavar="STAGE", help="DeepSpeedStrategy(stage=STAGE)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=6, help="validate every N training batches (with --eval-batches)")
    p.add_argument("--eval-batches", type=int, default=0, help="validation batches (default 0: no validation)")
    p.add_argument("--eval-step-time", type=float, default=0.0, help="seconds each validation batch takes")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    # Per-rank RNG streams (dropout differs per rank; spotguard keeps them apart).
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    model = Net(args.seed, args.hidden, args.step_time, None)
    model.eval_step_time = args.eval_step_time
    validation: dict[str, Any] = {"limit_val_batches": 0}
    if args.eval_batches > 0:  # a notice during validation is acted on at once (docs/frameworks.md)
        validation = {"limit_val_batches": args.eval_batches, "val_check_interval": args.eval_every}
    strategy: Any = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto"
    if args.deepspeed is not None:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = (deepspeed_strategy or DeepSpeedStrategy)(stage=args.deepspeed, process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=1,
        strategy=strategy,
        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, accumulate_grad_batches=args.accumulate, **validation,
    )
    ckpt_path = None
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook(trainer, storage=args.storage, every=args.every)  # <- the spotguard line
        if args.explicit_ckpt_path:
            ckpt_path = hook.latest()
    trainer.fit(model, train_dataloaders=Indices(args.batches_per_epoch), ckpt_path=ckpt_path,
                val_dataloaders=Indices(args.eval_batches) if args.eval_batches > 0 else None)

    if args.out and trainer.global_rank == 0:
        opt = trainer.optimizers[0]
        torch.save({"model": model.net.state_dict(), "optimizer": opt.state_dict(), "steps": trainer.global_step},
                   args.out)
    from _dist import leave_process_group  # examples/_dist.py, next to this script

    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
