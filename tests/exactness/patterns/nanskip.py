"""DDP on 2 ranks whose data holds a few corrupt samples (NaN features): the loop skips ``optimizer.step()`` when
the gradient norm is not finite, as large-model training loops do on a loss spike — some iterations step the
optimizer zero times. ``clip_grad_norm_``, LambdaLR warm-up and an own loop: ``hook.resume()`` +
``range(start, total)`` (the implicit clock, pattern ``nanskip``), or with ``EXO_RANGE=1`` ``hook.range(total)``
(pattern ``nanskip_range``). Each iteration's record carries ``opt_steps`` (AdamW's own count): under the implicit
clock a checkpoint's step is that count, not the iterations."""

from __future__ import annotations

import os
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _common import Net, _rt, batches, dataset, setup
from spotguard import install_preemption_hook
from spotguard.data import ElasticDistributedSampler

rank = setup()
torch.manual_seed(0)
data_set = dataset()
data_set.tensors[0][[5, 50]] = float("nan")  # two corrupt records
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
sampler = ElasticDistributedSampler(data_set, shuffle=True, seed=0)
loader = DataLoader(data_set, batch_size=8, sampler=sampler, generator=torch.Generator())
state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
hook = install_preemption_hook(state, storage=_rt.storage())
_rt.inside_step(opt)


def iterations() -> Iterator[int]:
    """The loop's clock: the user's own ``range`` after ``hook.resume()``, or ``hook.range()``."""
    if os.environ.get("EXO_RANGE") == "1":
        first = True
        for i in hook.range(_rt.steps()):
            if first:  # hook.range resumed before yielding
                _rt.resumed(hook, i, state)
                first = False
            yield i
        if first:  # resumed at the last step: nothing left to train
            _rt.resumed(hook, _rt.steps(), state)
        return
    start = hook.resume()
    _rt.resumed(hook, start, state)
    yield from range(start, _rt.steps())


def opt_steps() -> int:
    first = next(iter(opt.state.values()), {})
    return int(first["step"]) if "step" in first else 0


data = batches(loader, sampler)
for i in iterations():
    _rt.begin_iteration(i)
    _rt.phase("load")
    x, y = next(data)
    _rt.phase("fwd")
    loss = F.mse_loss(model(x), y)
    _rt.phase("bwd")
    opt.zero_grad()
    loss.backward()
    _rt.phase("prestep")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if torch.isfinite(norm):
        opt.step()
        _rt.phase("after")
        sched.step()
    _rt.end_iteration(i, state, opt_steps=opt_steps())
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
