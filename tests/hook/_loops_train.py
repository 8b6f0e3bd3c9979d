"""One training loop written the ways users write it, for notices at any moment (issue 23).

``--loop plain`` (``hook.resume()`` + ``for i in range(start, steps)``), ``range`` (``for i in
hook.range(steps)``, the README's pattern) or ``step`` (``hook.step()`` at the end of each iteration);
``--single``: one process without ``torch.distributed`` (a one-GPU spot VM), else 2 ranks under torchrun
(gloo, DDP). Each iteration: load -> [work: ``--iter-s`` seconds of sleep standing for a long forward, from
iteration ``--slow-from`` on, after the forward] -> backward -> ``opt.step()`` every ``--accum`` iterations ->
``sched.step()``. ``--notice-at ITER`` hands rank ``--notice-rank`` a preemption notice (deadline
``--deadline`` s) through ``hook.notify`` right after iteration ITER's forward, and prints ``notice_sent``.
Dropout and a numpy draw make every RNG matter; ``--out`` writes the final state, so an interrupted and
resumed run can be compared bitwise with ``--no-hook``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


class Loader:
    """A stateful per-rank loader: batch ``pos`` is a pure function of (seed, rank, pos)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * (self.rank + 1) + self.pos)
        self.pos += 1
        x = torch.randn(8, 16, generator=g)
        return x, x.sum(dim=1, keepdim=True).tanh()

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=("plain", "range", "step"), default="plain")
    p.add_argument("--single", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--iter-s", type=float, default=0.0)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--notice-at", type=int, default=-1)
    p.add_argument("--notice-rank", type=int, default=0)
    p.add_argument("--deadline", type=float, default=8.0)
    p.add_argument("--storage", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-hook", action="store_true")
    p.add_argument("--gan", type=int, default=0,
                   help="N > 0: a GAN instead (optimizers opt_d, opt_g): N discriminator steps, then one "
                        "generator step per iteration; the slow part and the notice come in the first "
                        "discriminator pass, before any optimizer step of the iteration")
    p.add_argument("--double-at", type=int, default=-1,
                   help="iteration ITER steps the optimizer twice (a second backward/step after the first), "
                        "with --notice-at ITER: the notice comes between the two steps (--gan: a second "
                        "generator step)")
    p.add_argument("--d-skip", default="",
                   help="--gan: comma-separated iterations whose discriminator does not step (a warm-up of G, "
                        "D skipped when too strong); the notice then comes at the iteration's top")
    p.add_argument("--g-every", default="1:0",
                   help="--gan K:P: the generator steps only in iterations i with i %% K == P (PyTorch-GAN's "
                        "wgan.py: D every batch, G every n_critic batches)")
    p.add_argument("--g-first", action="store_true", help="--gan: the generator's step before D's")
    p.add_argument("--scaler-once", action="store_true",
                   help="--gan 1 --scaler: one scaler.update() per iteration, after G's step (scaler.step(opt_d), "
                        "scaler.step(opt_g), scaler.update(): PyTorch's AMP recipe for several optimizers)")
    p.add_argument("--scaler", action="store_true",
                   help="--gan: a CPU GradScaler in the dict, scaler.step(opt); scaler.update() after each D and G "
                        "backward (an AMP WGAN as written after the AMP examples' one-optimizer loop)")
    p.add_argument("--notice-after-d", type=int, default=0, metavar="K",
                   help="--gan: the notice and the slow part right after the K-th discriminator step of the "
                        "iteration (before the next critic step or G's), not before D's first step")
    p.add_argument("--mix", action="store_true",
                   help="--gan --single: a Linear shared by D and G (in both models and both optimizers), D with "
                        "spectral_norm and SGD momentum, its ExponentialLR stepped right after its step; G AdamW "
                        "amsgrad")
    p.add_argument("--late-head", type=int, default=-1, metavar="K",
                   help="--gan --single: a D parameter used (given a gradient, so its optimizer state created) only "
                        "from iteration K on")
    p.add_argument("--ema-d", action="store_true",
                   help="--gan --single: an AveragedModel EMA of D in the dict, updated right after each D step")
    p.add_argument("--add-group", type=int, default=-1, metavar="K",
                   help="--gan --single --late-head K: the late parameter joins D's optimizer as a new param group "
                        "(add_param_group) at the top of iteration K, not at its construction")
    p.add_argument("--notice-late", action="store_true",
                   help="--gan: the notice at the iteration's end (after G's step and the scheduler), not in D's "
                        "first pass")
    a = p.parse_args()
    d_skip = {int(x) for x in a.d_skip.split(",") if x}
    g_every, g_phase = (int(x) for x in a.g_every.split(":"))

    rank = 0
    if not a.single:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(32, 1))
    shared = torch.nn.Linear(16, 16)  # --mix: a conditional GAN's shared layer (in D and in G)
    if a.mix:
        net = torch.nn.Sequential(shared, torch.nn.utils.spectral_norm(torch.nn.Linear(16, 32)), torch.nn.ReLU(),
                                  torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    if a.late_head >= 0:
        net.register_parameter("late", torch.nn.Parameter(torch.zeros(1)))
    model: Any = net if a.single else torch.nn.parallel.DistributedDataParallel(net)
    dparams = [p for n, p in model.named_parameters() if not (a.add_group >= 0 and n == "late")]
    opt = torch.optim.AdamW(dparams, lr=1e-2) if not a.mix else torch.optim.SGD(dparams, lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if not a.mix else \
        torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)  # --mix: D's lr moves at every step
    loader = Loader(rank)
    torch.manual_seed(10 + rank)
    np.random.seed(10 + rank)
    random.seed(10 + rank)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    if a.gan:  # the generator and both optimizers (the discriminator is the model above)
        torch.manual_seed(1)
        gnet = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        if a.mix:
            gnet = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), shared)
        gmodel: Any = gnet if a.single else torch.nn.parallel.DistributedDataParallel(gnet)
        opt_g = torch.optim.Adam(gmodel.parameters(), lr=2e-3, betas=(0.5, 0.999)) if not a.mix else \
            torch.optim.AdamW(gmodel.parameters(), lr=2e-3, amsgrad=True)
        state = {"model": model, "gen": gmodel, "opt_d": opt, "opt_g": opt_g, "scheduler": sched, "loader": loader}
        if a.ema_d:
            state["ema_d"] = torch.optim.swa_utils.AveragedModel(
                net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        if a.scaler:
            state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        torch.manual_seed(10 + rank)  # the generator's init drew from seed 1: back to this rank's stream

    def stepped(o: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        """backward and step, through the GradScaler with --scaler"""
        sc = state.get("scaler")
        if sc is None:
            loss.backward()
            o.step()
            return
        sc.scale(loss).backward()
        sc.step(o)
        if not (a.scaler_once and o is opt):
            sc.update()

    hook = None
    if not a.no_hook:
        from spotguard import install_preemption_hook  # noqa: PLC0415

        hook = install_preemption_hook(state, storage=a.storage)

    def notify(i: int) -> None:
        if hook is None or i != a.notice_at or rank != a.notice_rank:
            return
        from spotguard.notice import Notice  # noqa: PLC0415
        from spotguard.timefmt import utcnow  # noqa: PLC0415

        now = utcnow()
        print(json.dumps({"notice_sent": i, "t": time.time(), "rank": rank}), flush=True)
        hook.notify(Notice(id=f"drill-{i}-{os.getpid()}", source="drill", kind="preemption",
                           deadline=now + timedelta(seconds=a.deadline), received_at=now))

    def gan_iteration(i: int) -> None:
        """D ``--gan`` times (real vs. generated), then G once; the slow part in D's first pass."""
        bce = torch.nn.BCEWithLogitsLoss()
        g_steps = i % g_every == g_phase
        if a.g_first and g_steps:
            g_step(i, bce)
        if i in d_skip and not a.notice_late:
            notify(i)
        if i == a.add_group:
            opt.add_param_group({"params": [net.late], "lr": 1e-3})
        for c in range(0 if i in d_skip else a.gan):
            x, _ = next(loader)
            x = x + 0.01 * float(np.random.randn())
            fake = gmodel(torch.randn(8, 16))
            real_out = model(x)
            if 0 <= a.late_head <= i:
                real_out = real_out + net.late
            if c == 0 and not a.notice_late and not a.notice_after_d:
                notify(i)
                if i >= a.slow_from:
                    time.sleep(a.iter_s)  # the workload: a long forward/backward (not a synchronisation)
            loss_d = bce(real_out, torch.ones(8, 1)) + bce(model(fake.detach()), torch.zeros(8, 1))
            opt.zero_grad(set_to_none=True)
            stepped(opt, loss_d)
            if a.ema_d:
                state["ema_d"].update_parameters(net)
            if a.mix and c == 0:
                sched.step()  # D's scheduler right after D's step, inside the iteration
            if c + 1 == a.notice_after_d:
                notify(i)
                if i >= a.slow_from:
                    time.sleep(a.iter_s)  # the workload, after this D step (not a synchronisation)
        if g_steps and not a.g_first:
            g_step(i, bce)
        if not a.mix:
            sched.step()
        if a.notice_late:
            notify(i)
        if rank == 0:
            print(json.dumps({"step": i, "loss": float(loss_d) if i not in d_skip else 0.0, "t": time.time()}),
                  flush=True)

    def g_step(i: int, bce: torch.nn.Module) -> None:
        loss_g = bce(model(gmodel(torch.randn(8, 16))), torch.ones(8, 1))
        opt_g.zero_grad(set_to_none=True)
        stepped(opt_g, loss_g)
        if i == a.double_at:  # an irregular iteration: a second generator step
            opt_g.zero_grad(set_to_none=True)
            bce(model(gmodel(torch.randn(8, 16))), torch.ones(8, 1)).backward()
            opt_g.step()

    def iteration(i: int) -> None:
        if a.gan:
            gan_iteration(i)
            return
        x, y = next(loader)
        x = x + 0.01 * float(np.random.randn())
        out = model(x)
        if i != a.double_at:
            notify(i)
        if i >= a.slow_from:
            time.sleep(a.iter_s)  # the workload: a long forward/backward (not a synchronisation)
        loss = F.mse_loss(out, y) / a.accum
        loss.backward()
        if (i + 1) % a.accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        if i == a.double_at:  # an extra step in this iteration (the notice lands between the two)
            notify(i)
            if a.iter_s:
                time.sleep(a.iter_s)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(json.dumps({"step": i, "loss": float(loss), "t": time.time()}), flush=True)

    if hook is None:
        for i in range(a.steps):
            iteration(i)
    elif a.loop == "range":
        for i in hook.range(a.steps):
            iteration(i)
    else:
        start = hook.resume()
        for i in range(start, a.steps):
            iteration(i)
            if a.loop == "step":
                hook.step()
    if a.out and rank == 0:
        if a.gan:
            extra = {"gen": {k: v.clone() for k, v in gnet.state_dict().items()}, "opt_g": opt_g.state_dict()}
            if a.ema_d:
                extra["ema_d"] = {k: v.clone() for k, v in state["ema_d"].state_dict().items()}
        else:
            extra = {}
        torch.save({**extra, "model": {k: v.clone() for k, v in net.state_dict().items()}, "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "loader": loader.state_dict(),
                    "rng": torch.get_rng_state()}, a.out)
    if not a.single:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
