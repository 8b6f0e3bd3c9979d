"""Plain DDP on 2 ranks: dropout, numpy/python-random augmentation, AdamW, StepLR, an evaluation every 4th
iteration. ``hook.resume()`` and the user's own loop: the hook acts on a notice at any moment. The oracle's
``ddp_every`` variant adds ``every=``/``keep=`` and a slow store (``_rt.store()``): periodic uploads in flight."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

rank = setup()
torch.manual_seed(0)
data_set = dataset()
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.store(), every=_rt.every(), keep=_rt.keep())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
x_eval = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    x, y = next(data)
    x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * random.random()
    _rt.phase("fwd")
    loss = F.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    sched.step()
    if i % 4 == 3:
        model.eval()
        with torch.no_grad():
            _rt.phase("eval")
            model(x_eval)
        model.train()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
