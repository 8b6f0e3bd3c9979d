"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on a CPU device mesh of 2 ranks: Adam, StepLR, dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

rank = setup()
torch.manual_seed(0)
net = Net()
mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
fully_shard(net.fc1, mesh=mesh)
fully_shard(net.fc2, mesh=mesh)
model = fully_shard(net, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
state = {"model": model, "optimizer": opt, "scheduler": sched}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
# the forward and backward phases are inside FSDP2's unsharded window: in fc2's forward (after FSDP's own
# pre-forward hook gathered its parameters) and in the backward, before fc1's (its parameters gathered again)
net.fc2.register_forward_pre_hook(lambda m, a: _rt.phase("fwd"))
net.fc1.register_full_backward_pre_hook(lambda m, go: _rt.phase("bwd"))
start = hook.resume()
_rt.resumed(hook, start, state)
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    g = torch.Generator().manual_seed(i * 2 + rank)
    x = torch.randn(8, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
