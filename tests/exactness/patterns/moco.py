"""DDP on 2 ranks, a MoCo-style model: a momentum (key) encoder inside the model, updated in place *inside the
model's forward* before it encodes the keys (``_momentum_update_key_encoder()`` as the MoCo v1/v2/v3 reference code
does), and a queue buffer of past keys enqueued in the forward. One optimizer (the query encoder's parameters),
``hook.resume()`` and an own loop."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler


class MoCo(torch.nn.Module):
    def __init__(self, m: float = 0.9, queue: int = 32) -> None:
        super().__init__()
        self.encoder_q = Net(d_out=4)
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.m = m
        self.register_buffer("queue", F.normalize(torch.randn(queue, 4), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        for pk, pq in zip(self.encoder_k.parameters(), self.encoder_q.parameters()):
            pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, k: torch.Tensor) -> None:
        n, p = k.shape[0], int(self.ptr)
        self.queue[p:p + n] = k
        self.ptr.fill_((p + n) % self.queue.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(x), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(x + 0.05 * torch.randn_like(x)), dim=1)
        pos = (q * k).sum(dim=1, keepdim=True)
        neg = q @ self.queue.clone().t()
        logits = torch.cat([pos, neg], dim=1) / 0.2
        if self.training:
            self._dequeue_and_enqueue(k)
        return F.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))


rank = setup()
torch.manual_seed(0)
data_set = dataset()
model = torch.nn.parallel.DistributedDataParallel(MoCo())
opt = torch.optim.SGD(model.module.encoder_q.parameters(), lr=0.05, momentum=0.9)
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
    x, _ = next(data)
    _rt.phase("fwd")
    loss = model(x)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    opt.step()
    _rt.phase("after")
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
