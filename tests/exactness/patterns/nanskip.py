"""DDP on 2 ranks whose data holds a few corrupt samples (NaN features): the loop skips ``optimizer.step()`` when
the gradient norm is not finite, as large-model training loops do on a loss spike — some iterations step the
optimizer zero times. ``clip_grad_norm_``, LambdaLR warm-up, ``hook.resume()`` and an own loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

rank = setup()
torch.manual_seed(0)
data_set = dataset()
data_set.tensors[0][[5, 50]] = float("nan")  # two corrupt records
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
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
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if torch.isfinite(norm):
        opt.step()
        _rt.phase("after")
        sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
