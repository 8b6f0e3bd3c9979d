"""DDP over a model with ``parametrizations.spectral_norm`` (its ``_u``/``_v`` buffers move in every training
forward) and BatchNorm (running statistics move in every forward too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import DataLoader

from _common import _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

rank = setup()
torch.manual_seed(0)
data_set = dataset()
net = torch.nn.Sequential(spectral_norm(torch.nn.Linear(16, 32)), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                          spectral_norm(torch.nn.Linear(32, 1)))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "sampler": sampler}
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
    opt.step()
    _rt.phase("after")
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
