"""A GAN loop as they are written in the wild, in ``for i in hook.range(n)`` (issue 23 review).

DCGAN-style G with BatchNorm, D and G wrapped by DDP separately, each with its own optimizer and scheduler:
``sched_d`` steps at the top of each iteration (before any optimizer step: "decay D's lr per iteration"),
``sched_g`` after G's step; WGAN weight clipping (``p.data.clamp_`` on D after each D step: a write outside
``step()``); an EMA of G updated after G's step (a module in the dict); samples of G drawn every 3rd iteration
before D's steps (eval mode, no grad). Switches:

- ``EXO_GW_NCRITIC``: D steps per G step (default 2); ``EXO_GW_WARMUP=K``: 3 D steps in the first K iterations,
  then ``EXO_GW_NCRITIC`` (WGAN-GP's schedule: more critic steps at first).
- ``EXO_GW_SKIP=1``: D's step skipped in every 4th iteration ("D too strong").
- ``EXO_GW_GP=1``: WGAN-GP's gradient penalty (``torch.autograd.grad(create_graph=True)``) instead of clipping.
- ``EXO_GW_CLIP_TOP=1``: the clamp before each critic step's forward (the original WGAN code), not after.
- ``EXO_GW_AMP=1``: a CPU ``GradScaler`` in the dict, ``scaler.step(opt); scaler.update()`` after each D and G
  backward (as AMP requires with n_critic: a second ``scaler.step(opt_d)`` before ``update()`` raises).
- ``EXO_GW_LOOP``: ``range`` (default), ``step`` (``hook.step()`` at each iteration's end), ``own`` (a plain loop).
- ``EXO_EVERY``: the hook's ``every=`` (periodic checkpoints).
- ``EXO_GW_SCHED_TOP=0``: ``sched_d`` steps at the iteration's end instead of its top — for the ``own`` loop,
  where a scheduler stepped at an iteration's top, before its forward, is the documented limit of every loop
  without ``hook.range()``/``hook.step()`` (docs/api.md: it counts into the previous iteration).
"""

from __future__ import annotations

import os

import torch

from _common import _rt, setup
from spotguard import install_preemption_hook

rank = setup()
ncritic = int(os.environ.get("EXO_GW_NCRITIC", "2"))
warmup = int(os.environ.get("EXO_GW_WARMUP", "0"))
skip = os.environ.get("EXO_GW_SKIP") == "1"
gp = os.environ.get("EXO_GW_GP") == "1"
clip_top = os.environ.get("EXO_GW_CLIP_TOP") == "1"
sched_top = os.environ.get("EXO_GW_SCHED_TOP", "1") == "1"
amp = os.environ.get("EXO_GW_AMP") == "1"
torch.manual_seed(0)
gen_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
disc_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
ema_g = torch.optim.swa_utils.AveragedModel(gen_net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
g, d = torch.nn.parallel.DistributedDataParallel(gen_net), torch.nn.parallel.DistributedDataParallel(disc_net)
opt_d = torch.optim.RMSprop(d.parameters(), lr=5e-3) if not gp else torch.optim.Adam(d.parameters(), lr=2e-3,
                                                                                      betas=(0.0, 0.9))
opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999))
sched_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=0.9)
sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)
state = {"gen": g, "disc": d, "ema_g": ema_g, "opt_d": opt_d, "opt_g": opt_g, "sched_d": sched_d,
         "sched_g": sched_g}
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if amp else None
if scaler is not None:
    state["scaler"] = scaler
hook = install_preemption_hook(state, storage=_rt.store(), every=_rt.every(), keep=_rt.keep())
fixed_z = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def backward(loss: torch.Tensor) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward()


def step(opt: torch.optim.Optimizer) -> None:
    if scaler is None:
        opt.step()
        return
    scaler.step(opt)
    scaler.update()


def critic_step(i: int, c: int) -> None:
    if clip_top:  # the original WGAN code clamps D's weights before each critic step's forward
        for p in d.parameters():
            p.data.clamp_(-0.05, 0.05)
    _rt.phase("load" if c == 0 else "critic_load")  # critic_load: after a critic step and its clamp_
    real = torch.randn(8, 8, generator=torch.Generator().manual_seed((i * 8 + c) * 2 + rank)) + 2.0
    z = torch.randn(8, 8)
    _rt.phase("fwd")
    fake = g(z).detach()
    opt_d.zero_grad()
    loss_d = d(fake).mean() - d(real).mean()
    if gp:
        alpha = torch.rand(8, 1)
        mix = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(d(mix).sum(), mix, create_graph=True)
        loss_d = loss_d + 10.0 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
    backward(loss_d)
    if skip and i % 4 == 2:
        return  # D too strong: no D step this iteration
    _rt.phase("d_step")
    step(opt_d)
    if not gp and not clip_top:
        for p in d.parameters():
            p.data.clamp_(-0.05, 0.05)


def iteration(i: int) -> None:
    _rt.begin_iteration(i)
    if i > 0 and sched_top:
        sched_d.step()  # D's lr decays per iteration, stepped at the top
    if i % 3 == 0:
        _rt.phase("eval")
        g.eval()
        with torch.no_grad():
            g(fixed_z)
        g.train()
    for c in range(3 if i < warmup else ncritic):
        critic_step(i, c)
    opt_g.zero_grad()
    loss_g = -d(g(torch.randn(8, 8))).mean()
    backward(loss_g)
    _rt.phase("g_step")
    step(opt_g)
    ema_g.update_parameters(gen_net)
    sched_g.step()
    if not sched_top:
        sched_d.step()
    _rt.phase("after")
    _rt.end_iteration(i, state)


loop = os.environ.get("EXO_GW_LOOP", "range")
if loop == "range":
    first = True
    for i in hook.range(_rt.steps()):
        if first:  # the oracle's record of the resumed state (hook.range resumed before yielding)
            _rt.resumed(hook, i, state)
            first = False
        iteration(i)
    if first:  # resumed at the last step: nothing left to train
        _rt.resumed(hook, _rt.steps(), state)
else:  # "step": hook.resume() and hook.step() at each iteration's end; "own": hook.resume() and a plain loop
    start = hook.resume()
    _rt.resumed(hook, start, state)
    for i in range(start, _rt.steps()):
        iteration(i)
        if loop == "step":
            hook.step()
_rt.finished(state, _rt.steps())
torch.distributed.destroy_process_group()
