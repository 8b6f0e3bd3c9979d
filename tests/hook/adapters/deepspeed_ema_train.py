"""A DeepSpeed ZeRO-2 loop whose user state changes after ``engine.step()`` (run by test_deepspeed_ema.py).

Beside the data position (a loader: it advances before the next forward) the loop keeps three objects given
to ``hook.add_state``: an EMA of the weights updated right after ``engine.step()`` (a model copy: large), a
running-loss meter updated between the backward and ``engine.step()`` (small) and a best-validation tracker
updated after an evaluation (``--eval-at``: the engine in eval mode under ``torch.no_grad()``, after the EMA
update). A checkpoint of step S must hold the EMA with update S in it, the meter as it was before iteration
S+1 touched it and the tracker with the evaluation after S. ``--out`` holds the final weights, the EMA
(``ema.*``), the meter and the tracker, so a resume is compared on all of them.

``--notice-after K``: rank 1 sends itself SIGUSR1 right after iteration K's EMA update (a notice between
``engine.step()`` and the loop's post-step work: K = steps - 1 is a notice after the last step); on the
any-moment path every rank then waits until its round is on (``_round_on``), so what follows (the evaluation,
the end of training) meets a round already waiting for the anchor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchrun_train import SyntheticLoader  # noqa: E402


class Ema:
    """Shadow weights, ``lerp_``-ed towards the module's after each step (whole parameters under ZeRO-2)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.shadow = {n: p.detach().clone() for n, p in module.named_parameters()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.module.named_parameters():
            self.shadow[n].lerp_(p.detach(), 0.1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.shadow.items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for n, t in sd.items():
            self.shadow[n].copy_(t)


class Meter:
    """A running loss sum and count, updated between the backward and engine.step()."""

    def __init__(self) -> None:
        self.total, self.n = 0.0, 0

    def add(self, v: float) -> None:
        self.total, self.n = self.total + v, self.n + 1

    def state_dict(self) -> dict[str, float]:
        return {"total": self.total, "n": self.n}

    def load_state_dict(self, sd: dict[str, float]) -> None:
        self.total, self.n = float(sd["total"]), int(sd["n"])


class Best:
    """The best validation loss so far and how many evaluations ran (a best-metric tracker, updated after an
    evaluation: state of the iteration whose post-step work holds the evaluation)."""

    def __init__(self) -> None:
        self.best, self.evals = float("inf"), 0

    def update(self, v: float) -> None:
        self.best, self.evals = min(self.best, v), self.evals + 1

    def state_dict(self) -> dict[str, float]:
        return {"best": self.best, "evals": self.evals}

    def load_state_dict(self, sd: dict[str, float]) -> None:
        self.best, self.evals = float(sd["best"]), int(sd["evals"])


def _round_on(hook: object, bound: float = 30.0) -> None:
    """(test only) Any-moment path: wait until this rank's agreement round is on (agreed, waiting for what it
    writes), so the loop's next forward meets it. The boundary path agrees at that forward: nothing to wait for."""
    end = time.monotonic() + bound
    while getattr(hook, "_ds_any", False) and getattr(hook, "_round_action", None) is None and \
            time.monotonic() < end:
        time.sleep(0.005)  # an attribute the agreement thread sets: nothing to await from here


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--storage", default=None)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds after the EMA update (the notice lands)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-hook", action="store_true")
    p.add_argument("--notice-after", type=int, default=None, help="rank 1 signals itself after this iteration")
    p.add_argument("--eval-at", type=int, default=None, help="an evaluation (no_grad) after this iteration")
    args = p.parse_args()
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(32, 1))
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
           "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    torch.manual_seed(8 + rank)
    random.seed(rank)
    np.random.seed(rank)
    data, ema, meter, best = SyntheticLoader(7, rank, batch=8), Ema(engine.module), Meter(), Best()
    xv, yv = next(SyntheticLoader(99, rank, batch=8))  # the validation batch (its own generator: no RNG drawn)
    hook, start = None, 0
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook(engine, storage=args.storage)
        hook.add_state("data", data)
        hook.add_state("ema", ema)
        hook.add_state("meter", meter)
        hook.add_state("best", best)
        start = hook.resume()
    engine.train()
    for step in range(start, args.steps):
        x, y = next(data)
        loss = F.mse_loss(engine(x) * (1.0 + 0.01 * random.random()), y)
        engine.backward(loss)
        meter.add(loss.item())
        engine.step()
        ema.update()
        if rank == 0:
            v = loss.item()
            print(json.dumps({"step": step, "loss": v, "hex": v.hex()}), flush=True)
        if step == args.notice_after and hook is not None:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            _round_on(hook)
        if step == args.eval_at:
            engine.eval()
            with torch.no_grad():
                val = F.mse_loss(engine(xv), yv).item()  # not the anchor: no grad
            engine.train()
            best.update(val)
            if rank == 0:
                print(json.dumps({"eval": step, "val": val.hex()}), flush=True)
        if args.step_time > 0:
            time.sleep(args.step_time)
    if args.out and rank == 0:
        sd = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        sd.update({f"ema.{n}": t.clone() for n, t in ema.shadow.items()})
        sd["meter"] = torch.tensor([meter.total, float(meter.n)], dtype=torch.float64)
        sd["best"] = torch.tensor([best.best, float(best.evals)], dtype=torch.float64)
        torch.save({"model": sd, "steps": args.steps}, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
