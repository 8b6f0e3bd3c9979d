"""DDP on 2 ranks, AdamW + ``ReduceLROnPlateau`` stepped on the validation loss: every 3rd iteration the model is
evaluated (the evaluation's forward is the model's first forward after ``optimizer.step()``) and the scheduler
steps on the result, after the evaluation — the way a plateau scheduler is always driven."""

from __future__ import annotations

import torch
import torch.distributed as dist
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
# threshold=0.5 (rel): the validation loss has to halve to count as an improvement, so the LR drops as the test runs
sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.5)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
g = torch.Generator().manual_seed(7)
x_val = torch.randn(32, 16, generator=g)
y_val = x_val.sum(dim=1, keepdim=True) * 0.1
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    x, y = next(data)
    _rt.phase("fwd")
    loss = F.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    if i % 3 == 2:
        model.eval()
        with torch.no_grad():
            _rt.phase("eval")
            val = F.mse_loss(model(x_val), y_val)
        dist.all_reduce(val)
        model.train()
        _rt.phase("plateau")
        sched.step(val.item() / dist.get_world_size())
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
