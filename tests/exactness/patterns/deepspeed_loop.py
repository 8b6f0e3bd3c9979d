"""DeepSpeed ZeRO on 2 ranks (gloo, CPU, ``DS_ACCELERATOR=cpu``): ``install_preemption_hook(engine)`` after
``deepspeed.initialize``, the user's own loop (``engine(x)``, ``engine.backward``, ``engine.step()``), dropout,
python/numpy noise in the loss, DeepSpeed's AdamW + WarmupDecayLR, a per-rank stateful batch source given to
``hook.add_state``. The hook acts after the ``engine.step()`` that advances ``global_steps``.

``EXO_ZERO`` (default 2): the ZeRO stage. Under ZeRO-3 the module's parameters are placeholders: the digest
takes each rank's partition (``ds_tensor``). ``EXO_ACCUM=N``: N micro-batches a step (phase ``micro`` before a
micro-batch's ``engine.step()`` that does not end the accumulation; the hook acts at the boundary only).

The digest holds the module's parameters, the ZeRO optimizer's partition (its fp32 master weights and the base
optimizer's state, read from the optimizer's own ``state_dict()``: a pure read; ZeRO-3: see ``optimizer()``), DeepSpeed's scheduler, the
engine's counters, the data position and the RNG.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import Net, _rt  # noqa: E402
from spotguard import install_preemption_hook  # noqa: E402

ZERO = int(os.environ.get("EXO_ZERO", "2"))
ACCUM = int(os.environ.get("EXO_ACCUM", "1"))
EMA = os.environ.get("EXO_EMA", "") == "1"  # review: an EMA of the weights updated after engine.step() (ZeRO-2)


class Batches:
    """Per-rank batches, batch ``pos`` a pure function of (rank, pos): its position is the data state."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.pos * 2 + self.rank)
        self.pos += 1
        x = torch.randn(8, 16, generator=g)
        return x, x.sum(dim=1, keepdim=True) * 0.1

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)  # identical initial weights on every rank
net = Net()
cfg = {
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": ACCUM, "steps_per_print": 10**9,
    "zero_optimization": {"stage": ZERO}, "zero_force_ds_cpu_optimizer": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 20}},
}
engine, _opt, _, _sched = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
torch.manual_seed(1 + rank)
random.seed(100 + rank)
np.random.seed(100 + rank)
data = Batches(rank)


ema = None
if EMA:  # an EMA of the module's weights, updated by the loop after engine.step() (as diffusion / LLM fine-tuning
    # loops do), given to hook.add_state; ZeRO-2: the module's parameters are whole on every rank. The class is
    # the adapter test's (tests/hook/adapters/deepspeed_ema_train.py: its training runs only as __main__)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hook" / "adapters"))
    from deepspeed_ema_train import Ema  # noqa: E402

    ema = Ema(engine.module)


def params() -> dict[str, torch.Tensor]:
    """The module's parameters as this rank holds them. ZeRO-3: its partition (the module's are placeholders)
    without the padding that rounds the last partition up: padding is never training state (after a resume
    DeepSpeed leaves it as it finds it), only the real elements are."""
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        part = getattr(p, "ds_tensor", None)
        if part is None:
            out[n] = p
            continue
        real = max(0, min(part.numel(), int(p.ds_numel) - rank * int(part.ds_numel)))
        out[n] = part.narrow(0, 0, real)
    return out


def optimizer() -> dict[str, object]:
    """The ZeRO optimizer's partition: fp32 master weights and the base optimizer's state (step, moments).
    ZeRO-3's flat fp32 group holds the padding too: its real elements are the model partition above (fp32
    training copies them into it after every step), so there only the base optimizer's state is taken."""
    sd = engine.optimizer.state_dict()
    keep = ("single_partition_of_fp32_groups", "optimizer_state_dict", "base_optimizer_state")
    return {k: sd[k] for k in keep if k in sd}


state = {
    "model": params, "optimizer": optimizer, "scheduler": engine.lr_scheduler, "data": data,
    "engine": lambda: {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                       "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps},
}
ds_step = engine.step


def step_and_record() -> None:
    """The iteration ends inside the ``engine.step()`` that advances ``global_steps``, before the hook's boundary
    (installed after this wrapper, so it runs after it): a notice acted on there exits from inside the step, and
    the step it commits is recorded as trained (as a user callback ahead of spotguard's under Lightning). With
    ``EXO_EMA`` the iteration ends after the loop's EMA update instead (the hook reads add_state objects at the
    next iteration's first forward)."""
    before = engine.global_steps
    ds_step()
    if engine.global_steps != before and ema is None:
        _rt.end_iteration(int(engine.global_steps) - 1, state)


engine.step = step_and_record
hook = install_preemption_hook(engine, storage=_rt.storage())
hook.add_state("data", data)
if ema is not None:
    state["ema"] = lambda: ema.shadow
    hook.add_state("ema", ema)
start = hook.resume()
_rt.resumed(hook, start, state)
engine.train()
for i in range(start, _rt.steps()):
    _rt.begin_iteration(i)
    for m in range(ACCUM):
        _rt.phase("load")
        x, y = next(data)
        noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
        _rt.phase("fwd")
        loss = F.mse_loss(engine(x) * noise, y)
        _rt.phase("bwd")
        engine.backward(loss)
        _rt.phase("prestep" if m == ACCUM - 1 else "micro")
        engine.step()  # the hook's boundary when it advances global_steps
    if ema is not None:
        ema.update()
        _rt.end_iteration(int(engine.global_steps) - 1, state)  # the iteration's post-step work is over
    _rt.phase("after")  # the iteration's record was written at its engine.step()
_rt.finished(state, _rt.steps())
torch.distributed.barrier()
torch.distributed.destroy_process_group()
