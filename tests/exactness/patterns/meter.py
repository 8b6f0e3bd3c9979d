"""DDP on 2 ranks with the bookkeeping every training loop logs: a running-loss meter and a tokens-seen counter,
one user stateful object in the hook's dict (so a resumed run's averages and token count continue). It is updated
where logging loops update it: right after the loss is computed, before ``backward()`` and ``optimizer.step()``.
Also ``clip_grad_norm_`` and ``zero_grad(set_to_none=False)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler


class Meter:
    """Running mean of the training loss and the number of samples seen (a torchmetrics/`AverageMeter` idiom)."""

    def __init__(self) -> None:
        self.count, self.total, self.samples = 0, 0.0, 0

    def update(self, loss: float, n: int) -> None:
        self.count += 1
        self.total += loss
        self.samples += n

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total, "samples": self.samples}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count, self.total, self.samples = sd["count"], sd["total"], sd["samples"]


rank = setup()
torch.manual_seed(0)
data_set = dataset()
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
meter = Meter()
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "meter": meter}
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
    meter.update(loss.item(), x.shape[0])
    _rt.phase("bwd")
    opt.zero_grad(set_to_none=False)
    loss.backward()
    _rt.phase("prestep")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    _rt.phase("after")
    sched.step()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
