"""Two optimizers, GAN-style on DDP: the discriminator's step, then the generator's."""

from __future__ import annotations

import torch

from _common import _rt, setup
from spotguard import install_preemption_hook

rank = setup()
torch.manual_seed(0)
gen_net, disc_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), \
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
g, d = torch.nn.parallel.DistributedDataParallel(gen_net), torch.nn.parallel.DistributedDataParallel(disc_net)
opt_d = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999))
state = {"gen": g, "disc": d, "opt_d": opt_d, "opt_g": opt_g}
hook = install_preemption_hook(state, storage=_rt.storage())
start = hook.resume()
_rt.resumed(hook, start, state)
bce = torch.nn.BCEWithLogitsLoss()
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    _rt.phase("load")
    real = torch.randn(8, 8, generator=torch.Generator().manual_seed(i * 2 + rank)) + 2.0
    z = torch.randn(8, 8)
    _rt.phase("fwd")
    fake = g(z)
    opt_d.zero_grad()
    loss_d = bce(d(real), torch.ones(8, 1)) + bce(d(fake.detach()), torch.zeros(8, 1))
    loss_d.backward()
    _rt.phase("d_step")
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(d(fake), torch.ones(8, 1))
    loss_g.backward()
    _rt.phase("g_step")
    opt_g.step()
    _rt.phase("after")
    _rt.end_iteration(i, state)
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
