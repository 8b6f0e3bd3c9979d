"""Accelerate as fine-tuning scripts write it (review of issue 23): BatchNorm + dropout, bf16 autocast,
``accelerator.clip_grad_norm_``, a warmup ``LambdaLR``, numpy/python-random augmentation, an evaluation every 3rd
iteration (``model.eval()`` + ``no_grad``), the user's own ``accelerator.save_state`` every 4th iteration (its own
folder) and ``accelerator.log``-style ``gather`` of the loss. All accepted by ``any_moment_refusal``: the
any-moment path must stay exact here.

The inputs are the same on both ranks (the noise goes to the targets), so that BatchNorm's running statistics are:
``save_state`` writes rank 0's model only, so with per-rank inputs rank 1's statistics at S are rank 0's after the
resume on either path (DDP's ``broadcast_buffers`` puts rank 0's in at the next forward: the run ends bitwise).

``EXO_AW_NOSAVE=1``: without the user's own ``save_state``. ``EXO_AW_LOADER=1``: a prepared, shuffled
``DataLoader`` (``use_seedable_sampler``, ``set_epoch``), resumed mid-epoch with ``accelerator.skip_first_batches`` as
the Accelerate docs and the adapter's docstring say (per-rank batches: with ``EXO_AW_NORM=ln`` a LayerNorm instead
of the BatchNorm). ``EXO_AW_TAIL=SECONDS``: slow post-training work after the loop (phase ``tail``).
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from _common import _rt, setup
from spotguard import install_preemption_hook


class BNNet(torch.nn.Module):
    """An MLP with BatchNorm (running statistics move at each training forward) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        # per-rank batches (EXO_AW_LOADER): LayerNorm, see the module docstring
        self.bn = torch.nn.LayerNorm(32) if os.environ.get("EXO_AW_NORM") == "ln" else torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


setup(distributed=False)
LOADER = os.environ.get("EXO_AW_LOADER") == "1"
SCHED_TOP = os.environ.get("EXO_AW_SCHED_TOP") == "1"
accelerator = Accelerator(cpu=True, mixed_precision=os.environ.get("EXO_AW_MP", "bf16"),
                          dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
rank = accelerator.process_index
torch.manual_seed(0)
net = BNNet()
opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))  # warmup
gd = torch.Generator().manual_seed(1234)
xs = torch.randn(80, 16, generator=gd)
loader = DataLoader(TensorDataset(xs, xs.sum(dim=1, keepdim=True) * 0.1), batch_size=8, shuffle=True)
model, opt, sched, loader = accelerator.prepare(net, opt, sched, loader)
sched2 = None
if os.environ.get("EXO_AW_TWO_SCHED") == "1":  # a second prepared scheduler on the same optimizer: scheduler_1.bin
    sched2 = accelerator.prepare(torch.optim.lr_scheduler.ExponentialLR(opt.optimizer, gamma=0.9))
torch.manual_seed(1 + rank)
state = {"model": model, "optimizer": opt, "scheduler": sched, **({"scheduler2": sched2} if sched2 else {})}
hook = install_preemption_hook(accelerator, storage=_rt.storage())
start = hook.resume()
_rt.resumed(hook, start, state)
own = tempfile.mkdtemp(prefix="aw-own-")
x_eval = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
model.train()
it = None
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    if SCHED_TOP:  # the pre-1.1 PyTorch order: the scheduler stepped at the iteration's top
        sched.step()
    _rt.phase("load")
    if LOADER:  # the Accelerate docs' resume: skip_first_batches in the first (partial) epoch; 5 batches an epoch
        n = len(loader)
        if it is None or i % n == 0:
            loader.set_epoch(i // n)
            it = iter(accelerator.skip_first_batches(loader, i % n) if it is None and i % n else loader)
        x, y = next(it)
    else:
        g = torch.Generator().manual_seed(i * 2)  # the same inputs on both ranks: see the module docstring
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1
    y = y + 0.01 * torch.from_numpy(np.random.randn(*y.shape).astype(np.float32)) * random.random()
    _rt.phase("fwd")
    loss = F.mse_loss(model(x).float(), y)
    _rt.phase("bwd")
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 0.5)
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    if not SCHED_TOP:
        sched.step()
    if sched2 is not None:
        sched2.step()
    opt.zero_grad()
    accelerator.gather(loss.detach()).mean().item()  # logging
    if i % 3 == 2:
        model.eval()
        with torch.no_grad():
            _rt.phase("eval")
            model(x_eval)
        model.train()
    if i % 4 == 3 and os.environ.get("EXO_AW_NOSAVE") != "1":
        _rt.phase("ownsave")
        accelerator.save_state(own)
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
if os.environ.get("EXO_AW_TAIL"):  # after the loop: the final model saved, then slow post-training work
    accelerator.wait_for_everyone()
    _rt.phase("tail")
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(own, "final.pt"))
    time.sleep(float(os.environ["EXO_AW_TAIL"]))
accelerator.end_training()
