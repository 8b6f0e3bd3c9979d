"""DDP + a CPU ``torch.amp.GradScaler`` whose scale starts so high that the large batches (iterations 1, 5, 9)
overflow: ``scaler.step`` skips ``optimizer.step()`` there and the scale halves (tests/hook/_models_train.py)."""

from __future__ import annotations

import torch

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

rank = setup()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(Net(d_in=8, hidden=16))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=3)
state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i * 2 + rank))
    x = x * 100 if i % 4 == 1 else x
    _rt.phase("fwd")
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    _rt.phase("bwd")
    scaler.scale(loss).backward()
    _rt.phase("prestep")
    scaler.step(opt)
    scaler.update()
    _rt.phase("after")
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
