"""Accelerate on 2 ranks (gloo, CPU): ``install_preemption_hook(accelerator)`` after ``prepare``, its training
step (``accelerator.backward``), dropout, AdamW, StepLR. Without accumulation a notice is written from the
background for the last completed step, in ``save_state``'s files (``accelerate_anymoment.py``); with it, by
``save_state`` at the next micro-batch.

``EXO_ACCUM=N`` (pattern ``accelerate_accum``): ``Accelerator(gradient_accumulation_steps=N)`` and N micro-batches
an iteration inside ``accelerator.accumulate(model)``; ``opt.step()``/``sched.step()`` are called on every one
(Accelerate skips them until the last); written from the background for the last completed optimizer step as
well. Phase ``micro``: after the backward of a micro-batch that does not sync. ``EXO_ACC_SYNC_ONLY=1`` (pattern
``accelerate_accum_synconly``): the loop steps only ``if accelerator.sync_gradients``. ``EXO_ACC_SCHED_FREE=1``
(review obrev): ``step_scheduler_with_optimizer=False``: ``sched.step()`` after ``opt.step()`` steps the scheduler
on every micro-batch (the usual order, a scheduler counted in micro-batches).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

setup(distributed=False)  # Accelerator creates the process group itself
ACCUM = int(os.environ.get("EXO_ACCUM", "1"))
SYNC_ONLY = os.environ.get("EXO_ACC_SYNC_ONLY") == "1"
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM,
                          step_scheduler_with_optimizer=os.environ.get("EXO_ACC_SCHED_FREE") != "1")
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
    for m in range(ACCUM):
        _rt.phase("load")
        g = torch.Generator().manual_seed((i * ACCUM + m) * 2 + rank)
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1
        with accelerator.accumulate(model):
            _rt.phase("fwd")
            loss = F.mse_loss(model(x), y)
            _rt.phase("bwd")
            accelerator.backward(loss)
            if not accelerator.sync_gradients:
                _rt.phase("micro")
            else:
                _rt.phase("prestep")
            if SYNC_ONLY and not accelerator.sync_gradients:
                continue
            opt.step()  # skipped by Accelerate until the last micro-batch
            if accelerator.sync_gradients:
                _rt.phase("after")
            sched.step()
            opt.zero_grad()  # Accelerate zeroes only after the step (a micro-batch that syncs)
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
accelerator.end_training()  # destroys the process group
