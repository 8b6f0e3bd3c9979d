"""Accelerate on 2 ranks (gloo, CPU): ``install_preemption_hook(accelerator)`` after ``prepare``, its training
step (``accelerator.backward``), dropout, AdamW, StepLR. The framework writes its own checkpoint
(``save_state``) at the step boundary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

setup(distributed=False)  # Accelerator creates the process group itself
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
torch.manual_seed(0)
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
model, opt, sched = accelerator.prepare(net, opt, sched)
torch.manual_seed(1 + rank)
state = {"model": model, "optimizer": opt, "scheduler": sched}
hook = install_preemption_hook(accelerator, storage=_rt.storage())
start = hook.resume()
_rt.resumed(hook, start, state)
model.train()
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    g = torch.Generator().manual_seed(i * 2 + rank)
    x = torch.randn(8, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    _rt.phase("fwd")
    loss = F.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    accelerator.backward(loss)
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
accelerator.end_training()  # destroys the process group
