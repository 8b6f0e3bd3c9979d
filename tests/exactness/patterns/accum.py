"""DDP with gradient accumulation: 4 micro-batches per optimizer step, ``no_sync`` for all but the last."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

ACCUM = 4
rank = setup()
torch.manual_seed(0)
data_set = dataset(n=256)
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=4, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    opt.zero_grad()
    for m in range(ACCUM):
        x, y = next(data)
        ctx = model.no_sync() if m < ACCUM - 1 else contextlib.nullcontext()
        with ctx:
            _rt.phase("micro")
            (F.mse_loss(model(x), y) / ACCUM).backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
