"""DDP + a torch_ema-style EMA (``store``/``copy_to``/``restore`` through ``param.data.copy_``), swapped into
the model for an evaluation every 3rd iteration (``with ema.average_parameters():``); the EMA is in the dict."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler


class ExponentialMovingAverage:
    """What ``torch_ema.ExponentialMovingAverage`` does (it is not installed here), in its idiom."""

    def __init__(self, parameters: Any, decay: float) -> None:
        self.params = list(parameters)
        self.decay, self.num_updates = decay, 0
        self.shadow = [p.detach().clone() for p in self.params]
        self.collected: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        for s, p in zip(self.shadow, self.params):
            s.sub_((1 - d) * (s - p))

    def store(self) -> None:
        self.collected = [p.detach().clone() for p in self.params]

    def copy_to(self) -> None:
        for s, p in zip(self.shadow, self.params):
            p.data.copy_(s.data)

    def restore(self) -> None:
        assert self.collected is not None
        for c, p in zip(self.collected, self.params):
            p.data.copy_(c.data)

    @contextlib.contextmanager
    def average_parameters(self) -> Iterator[None]:
        self.store()
        self.copy_to()
        try:
            yield
        finally:
            self.restore()

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow_params": self.shadow,
                "collected_params": self.collected}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.decay, self.num_updates = sd["decay"], sd["num_updates"]
        for s, v in zip(self.shadow, sd["shadow_params"]):
            s.copy_(v)
        self.collected = sd["collected_params"]


rank = setup()
torch.manual_seed(0)
data_set = dataset()
net = Net()
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
ema = ExponentialMovingAverage(net.parameters(), decay=0.9)
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "ema": ema}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)
data = batches(loader, sampler)
x_eval = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
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
    ema.update()
    sched.step()
    if i % 3 == 2:
        model.eval()
        with ema.average_parameters(), torch.no_grad():
            _rt.phase("eval")
            net(x_eval)
        model.train()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
