"""A single process without ``torch.distributed`` (the one-GPU spot VM): dropout, numpy augmentation, AdamW,
StepLR, a resumable shuffled stream on a DataLoader with its own generator, an evaluation every 4th iteration."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, dataset, setup
from spotguard import install_preemption_hook


class ShuffledBatches:
    """An endless, resumable stream of shuffled batches (what torchdata's StatefulDataLoader gives): iterable
    with ``state_dict()``, so the hook treats it as a loader. Its state: epoch, batches taken in it, and the
    shuffling generator's state at the epoch's start."""

    def __init__(self, loader: DataLoader, gen: torch.Generator) -> None:
        self.loader, self.gen, self.epoch, self.taken = loader, gen, 0, 0
        self.epoch_start = gen.get_state()
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self.gen.set_state(self.epoch_start)
            self._it = iter(self.loader)
            for _ in range(self.taken):  # same generator state: same permutation; skip what was taken
                next(self._it)
        try:
            b = next(self._it)
        except StopIteration:
            self.epoch, self.taken, self.epoch_start, self._it = self.epoch + 1, 0, self.gen.get_state(), None
            return next(self)
        self.taken += 1
        return b

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "gen": self.epoch_start}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.taken, self.epoch_start, self._it = sd["epoch"], sd["taken"], sd["gen"], None


setup(distributed=False)
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
data_set = dataset()
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
gen = torch.Generator().manual_seed(5)
data = ShuffledBatches(DataLoader(data_set, batch_size=16, shuffle=True, generator=gen), gen)
state = {"model": model, "optimizer": opt, "scheduler": sched, "data": data}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)
start = hook.resume()
_rt.resumed(hook, start, state)

x_eval = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    x, y = next(data)
    x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * random.random()
    _rt.phase("fwd")
    loss = F.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    sched.step()
    if i % 4 == 3:
        model.eval()
        with torch.no_grad():
            _rt.phase("eval")
            model(x_eval)
        model.train()
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
