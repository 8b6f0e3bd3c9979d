"""SAM (sharpness-aware minimization) as its reference implementation is used: ``first_step`` perturbs the
weights under no_grad, a second forward/backward, ``second_step`` restores them and calls
``base_optimizer.step()``. ``SAM.step()`` itself is never called; the SAM object is the optimizer in the dict."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler


class SAM(torch.optim.Optimizer):
    """davda54/sam's SAM, trimmed."""

    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grad_norm = torch.norm(torch.stack([p.grad.norm(2) for g in self.param_groups for p in g["params"]
                                            if p.grad is not None]), 2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


rank = setup()
torch.manual_seed(0)
data_set = dataset()
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05)  # no momentum: SAM.state_dict() lacks the base
# optimizer's own state (a limitation of SAM, not of the hook)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.storage())
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    x, y = next(data)
    _rt.phase("fwd")
    F.mse_loss(model(x), y).backward()
    opt.first_step(zero_grad=True)
    _rt.phase("first")
    F.mse_loss(model(x), y).backward()
    _rt.phase("second")
    opt.second_step(zero_grad=True)
    _rt.phase("after")
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
