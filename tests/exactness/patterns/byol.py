"""DDP on 2 ranks, a BYOL/DINO-style teacher: a second model in the hook's dict, updated in place after every
``optimizer.step()`` (``torch.no_grad(): t.lerp_(s, 1 - m)``), evaluated without gradients for the student's
target. Also: two parameter groups (no weight decay on biases), ``clip_grad_norm_``, a LambdaLR warm-up,
``zero_grad(set_to_none=False)``, and a max-norm constraint on ``fc1`` applied by hand after the step."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

rank = setup()
torch.manual_seed(0)
data_set = dataset()
net = Net()
teacher = copy.deepcopy(net).requires_grad_(False)
model = torch.nn.parallel.DistributedDataParallel(net)
decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
no_decay = [p for n, p in net.named_parameters() if not n.endswith("weight")]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "teacher": teacher, "optimizer": opt, "scheduler": sched, "sampler": sampler}
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
    with torch.no_grad():
        target = teacher(x)
    out = model(x)
    loss = F.mse_loss(out, y) + 0.5 * F.mse_loss(out, target)
    _rt.phase("bwd")
    opt.zero_grad(set_to_none=False)
    loss.backward()
    _rt.phase("prestep")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    _rt.phase("after")
    with torch.no_grad():
        w = net.fc1.weight
        w.mul_(w.norm(dim=1, keepdim=True).clamp(min=1.0).reciprocal())  # max-norm 1 per unit
        for t, s in zip(teacher.parameters(), net.parameters()):
            t.lerp_(s, 0.1)
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
