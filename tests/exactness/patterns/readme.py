"""The README's script as a new user adapts it: an own model with dropout, AdamW, StepLR, an ``AveragedModel``
EMA in the dict, ``hook.range``. The DataLoader is built without a generator, so creating its iterator after
the resume draws from the global torch RNG the hook has just restored (``EXO_LOADER_GENERATOR=1``: the fix,
``DataLoader(..., generator=torch.Generator())``)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from _common import Net, _rt
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
random.seed(0)  # the hook saves and restores python's and numpy's RNG too: seeded, so the reference is repeatable
np.random.seed(0)
dataset = TensorDataset(torch.randn(96, 16), torch.randn(96, 1))
net = Net()
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=0)
gen = {"generator": torch.Generator()} if os.environ.get("EXO_LOADER_GENERATOR") == "1" else {}
loader = DataLoader(dataset, batch_size=8, sampler=sampler, **gen)
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "ema": ema}
hook = install_preemption_hook(state, storage=_rt.storage())


def batches():
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


data = batches()
first = True
for step in hook.range(_rt.steps()):
    if first:  # the oracle's record of the resumed state (hook.range resumed before yielding)
        _rt.resumed(hook, step, state)
        first = False
    _rt.begin_iteration(step)
    _rt.phase("load")
    x, y = next(data)
    _rt.phase("fwd")
    loss = torch.nn.functional.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    opt.step()
    ema.update_parameters(net)
    sched.step()
    _rt.phase("after")
    _rt.end_iteration(step, state)
if first:  # resumed at the last step: nothing left to train
    _rt.resumed(hook, _rt.steps(), state)
_rt.finished(state, _rt.steps())
dist.destroy_process_group()
