"""Lightning on 2 ranks (DDP over gloo, CPU): ``install_preemption_hook(trainer)``, ``accumulate_grad_batches=2``,
dropout, python/numpy noise in the loss, AdamW + a step-interval StepLR, an epoch boundary inside the run.

**Iteration** = one *optimizer step* (``trainer.global_step`` advances by one): two training batches here.
The phases are reached through Lightning's own hooks, in the order Lightning calls them:

- ``load`` / ``micro``: the module's ``on_train_batch_start`` of the first / second micro-batch (after every
  callback's, so after spotguard restored the RNG at the first batch of a resumed run);
- ``step``: a pre-hook on the torch optimizer (registered after the optimizer exists). Lightning calls
  ``optimizer.step(closure)`` and the closure runs the last micro-batch's ``training_step`` and backward, so
  this phase comes *before* that micro-batch's ``fwd``/``bwd``;
- ``fwd``: ``training_step``; ``bwd``: ``on_before_backward``; ``prestep``: ``on_before_optimizer_step``;
- ``after``: a callback's ``on_train_batch_end`` once the step and the step-interval scheduler are done; the
  callback is passed to ``Trainer(callbacks=...)``, so it runs before spotguard's (appended at install),
  whose ``on_train_batch_end`` is the boundary where a checkpoint is written. ``_rt.end_iteration`` is
  recorded there, before that boundary, because the checkpoint stands for exactly that state.

``_rt.resumed`` is recorded at the first batch's module ``on_train_batch_start``: Lightning has restored model,
optimizer, scheduler and loop progress (before ``on_train_start``) and spotguard has restored this rank's RNG
(its callback's ``on_train_batch_start``). Lightning's loop position is part of the state digest (``loop``:
global step, the next (epoch, batch index) to train, ``_batches_that_stepped``), taken at the end of each
iteration as it will stand when the next iteration starts. Each batch is built from (rank, epoch, batch
index), as ``examples/lightning_train.py`` does: Lightning restarts a plain loader's epoch iterator on a
resume but restores the batch index.
"""

from __future__ import annotations

import os
import random
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name works the same
    import pytorch_lightning as pl  # type: ignore[no-redef]
from lightning.fabric.plugins import TorchCheckpointIO

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

ACCUM = int(os.environ.get("EXO_ACCUM", "2"))  # 4 (lightning_accum4): steps end at batches 3, 7 and 9 (short)
VALSWAP = os.environ.get("EXO_VALSWAP") == "1"  # WeightAveraging swapped in at validations; a slow store
EMA = VALSWAP or os.environ.get("EXO_EMA") == "1"  # Lightning's WeightAveraging callback (an average of the weights)
SEEN = os.environ.get("EXO_SEEN") == "1"  # the module counts its training batches, saved in on_save_checkpoint
BATCHES = 10  # a 10-batch epoch is 5 optimizer steps: the 10 iterations cross an epoch boundary
rank = int(os.environ.get("RANK", "0"))
setup(distributed=False)  # Lightning creates the process group itself (inside fit)
random.seed(100 + rank)
np.random.seed(100 + rank)

POS: dict[str, Any] = {}  # Lightning's loop position, as the next iteration will find it (see the docstring)
_resumed = False
hook: Any = None


class Indices:
    """``BATCHES`` batch indices an epoch; the module builds each batch from (rank, epoch, index)."""

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor(i) for i in range(BATCHES))


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = Net()
        self.seen = 0  # EXO_SEEN: batches (micro-batches too) trained, a plain attribute saved by the module's hook

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        global _resumed
        tr = self.trainer
        if not _resumed:  # every callback ran: Lightning's restore and spotguard's RNG restore are done
            _resumed = True
            POS.update(global_step=tr.global_step, next=[tr.current_epoch, batch_idx],
                       batches_that_stepped=tr.fit_loop.epoch_loop._batches_that_stepped)
            _rt.resumed(hook, tr.global_step, state())
        _rt.begin_iteration(tr.global_step)
        _rt.phase("load" if batch_idx % ACCUM == 0 else "micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _rt.phase("fwd")
        self.seen += 1
        g = torch.Generator().manual_seed(rank * 10_007 + self.current_epoch * 1_009 + batch_idx)
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1
        x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * random.random()
        return F.mse_loss(self.net(x), y)  # dropout draws from the global torch RNG

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # EXO_VALSWAP: no RNG, no state moved
        import time  # noqa: PLC0415

        self.net(torch.ones(2, 16))
        time.sleep(1.0)  # a validation as long as the write: the average stays swapped in while it runs

    def on_before_backward(self, loss: torch.Tensor) -> None:
        _rt.phase("bwd")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        _rt.phase("prestep")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        _rt.inside_step(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Seen(Module):
    """EXO_SEEN: what a "tokens seen" counter in a user's module does (its own save/load hooks)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = checkpoint["seen"]


class Phases(pl.Callback):
    """The end of an iteration, before spotguard's boundary callback (it comes later in the list)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == POS.get("global_step"):
            return  # a micro-batch: no optimizer step, not an iteration
        nxt = [trainer.current_epoch, batch_idx + 1]
        if nxt[1] >= BATCHES:
            nxt = [nxt[0] + 1, 0]
        # _batches_that_stepped is counted after this hook (on_advance_end): +1 is its value at the end
        POS.update(global_step=trainer.global_step, next=nxt,
                   batches_that_stepped=trainer.fit_loop.epoch_loop._batches_that_stepped + 1)
        _rt.phase("after")
        _rt.end_iteration(trainer.global_step - 1, state())


class LossMeter(pl.Callback):
    """``EXO_METER=1``: a user callback with a tensor state updated in place at every batch's end (batches
    seen and a sum of their indices), saved through its ``state_dict``."""

    def __init__(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the same on every rank: Lightning saves rank 0's callback state and loads it on all
        self.sums.add_(torch.tensor([float(batch_idx), 1.0], dtype=torch.float64))

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sums.copy_(state_dict["sums"])


METER = LossMeter() if os.environ.get("EXO_METER") == "1" else None
class ValStart(pl.Callback):
    """EXO_VALSWAP: phase ``valstart`` as a validation starts (before spotguard's and WeightAveraging's hooks), half a
    second long (a validation loader's workers starting)."""

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        _rt.phase("valstart", sleep=False)
        import time  # noqa: PLC0415

        time.sleep(0.5)


class SlowIO(TorchCheckpointIO):
    """EXO_VALSWAP: Lightning's checkpoint file takes a second to write (a model of a few GB)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        import time  # noqa: PLC0415

        time.sleep(1.0)
        super().save_checkpoint(checkpoint, path, storage_options)


AVG: Any = None
if EMA:  # before Phases: the average is updated at a step's end before the iteration's end is recorded
    from lightning.pytorch.callbacks import WeightAveraging
    AVG = WeightAveraging()
module = Seen() if SEEN else Module()
torch.manual_seed(1 + rank)  # per-rank dropout streams
trainer = pl.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=1,
    strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
    max_steps=_rt.steps(), max_epochs=-1, accumulate_grad_batches=ACCUM,
    callbacks=[*([METER] if METER else []), *([AVG] if AVG else []), *([ValStart()] if VALSWAP else []), Phases()],
    **({"limit_val_batches": 1, "val_check_interval": 2 * ACCUM, "plugins": [SlowIO()]} if VALSWAP
       else {"limit_val_batches": 0}),
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0, use_distributed_sampler=False,
)


def state() -> dict[str, Any]:
    """What a resume must restore: weights, optimizer, scheduler, Lightning's loop position (RNG: ``_rt``)."""
    return {"model": module, "optimizer": trainer.optimizers[0],
            "scheduler": trainer.lr_scheduler_configs[0].scheduler, "loop": lambda: dict(POS),
            **({"meter": METER} if METER else {}),
            **({"average": lambda: AVG._average_model.state_dict()} if AVG else {}),
            **({"seen": lambda: {"seen": torch.tensor(module.seen)}} if SEEN else {})}


hook = install_preemption_hook(trainer, storage=_rt.storage())
trainer.fit(module, train_dataloaders=Indices(), val_dataloaders=Indices() if VALSWAP else None)
_rt.finished(state(), _rt.steps())
if torch.distributed.is_initialized():  # Lightning leaves its group alive (examples/_dist.py says why)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
