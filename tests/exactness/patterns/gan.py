"""Two optimizers, GAN-style on DDP: the discriminator's step, then the generator's.

``EXO_LOOP=range``: the README's ``for i in hook.range(n)`` loop instead of ``hook.resume()`` and an own loop,
with a StepLR on the discriminator (issue 23: there the boundaries prove each iteration's optimizer steps, so
notices are acted on at any moment); ``EXO_NCRITIC=N``: N discriminator steps per generator step (WGAN's
n_critic), each on its own batch. ``EXO_GAN_MIX=1`` (review ganrev, with ``range``): D with spectral_norm and SGD
momentum, its ExponentialLR stepped right after its step (inside the iteration), G AdamW with amsgrad.
"""

from __future__ import annotations

import os

import torch

from _common import _rt, setup
from spotguard import install_preemption_hook

rank = setup()
use_range = os.environ.get("EXO_LOOP") == "range"
ncritic = int(os.environ.get("EXO_NCRITIC", "1"))
mix = os.environ.get("EXO_GAN_MIX") == "1"
torch.manual_seed(0)
gen_net, disc_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), \
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
if mix:  # spectral norm's _u/_v move in every training forward of D (G's step runs one)
    torch.nn.utils.spectral_norm(disc_net[0])
g, d = torch.nn.parallel.DistributedDataParallel(gen_net), torch.nn.parallel.DistributedDataParallel(disc_net)
opt_d = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999)) if not mix else \
    torch.optim.SGD(d.parameters(), lr=2e-2, momentum=0.9)
opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999)) if not mix else \
    torch.optim.AdamW(g.parameters(), lr=2e-3, amsgrad=True)
state = {"gen": g, "disc": d, "opt_d": opt_d, "opt_g": opt_g}
sched_d = None
if use_range:
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=3, gamma=0.5) if not mix else \
        torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=0.9)
    state["sched_d"] = sched_d
hook = install_preemption_hook(state, storage=_rt.storage())
bce = torch.nn.BCEWithLogitsLoss()


def iteration(i: int) -> None:
    _rt.begin_iteration(i)
    for c in range(ncritic):
        _rt.phase("load" if c == 0 else "critic_load")  # critic_load: between two critic steps (n_critic > 1)
        seed = (i * ncritic + c) * 2 + rank if use_range else i * 2 + rank
        real = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)) + 2.0
        z = torch.randn(8, 8)
        _rt.phase("fwd")
        fake = g(z)
        opt_d.zero_grad()
        loss_d = bce(d(real), torch.ones(8, 1)) + bce(d(fake.detach()), torch.zeros(8, 1))
        loss_d.backward()
        _rt.phase("d_step")
        opt_d.step()
        if mix and c == 0:
            sched_d.step()  # D's lr right after its step, inside the iteration
    opt_g.zero_grad()
    loss_g = bce(d(g(torch.randn(8, 8)) if use_range else fake), torch.ones(8, 1))
    loss_g.backward()
    _rt.phase("g_step")
    opt_g.step()
    if sched_d is not None and not mix:
        sched_d.step()
    _rt.phase("after")
    _rt.end_iteration(i, state)


if use_range:
    first = True
    for i in hook.range(_rt.steps()):
        if first:  # the oracle's record of the resumed state (hook.range resumed before yielding)
            _rt.resumed(hook, i, state)
            first = False
        iteration(i)
    if first:  # resumed at the last step: nothing left to train
        _rt.resumed(hook, _rt.steps(), state)
else:
    start = hook.resume()
    _rt.resumed(hook, start, state)
    for i in range(start, _rt.steps()):
        iteration(i)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
