"""Time to safe with a framework owning the loop: the torchrun workers of ``time_to_safe.py --framework``.

Issue 23's framework patterns, each the way its documentation writes gradient accumulation:

- ``lightning``: a ``LightningModule`` under ``Trainer(strategy="ddp", accumulate_grad_batches=ACCUM)``;
- ``hf``: ``transformers.Trainer`` (DDP through torchrun, ``gradient_accumulation_steps=ACCUM``) over a
  plain ``nn.Module`` that returns ``{"loss": ...}``;
- ``accelerate``: ``Accelerator(gradient_accumulation_steps=ACCUM)`` and the documented loop
  (``with accelerator.accumulate(model): ... accelerator.backward(loss); opt.step(); sched.step();
  opt.zero_grad()``).

The model is the plain benchmark's (``LAYERS`` square ``Linear`` layers sized so that parameters + AdamW's
two moments are ``SG_TTS_STATE_MIB``), every layer trains under AdamW + ``LambdaLR``. The driver, the
daemon, the drill and the reading of the hook's log lines are ``time_to_safe.py``'s; this module only
paces the framework's loop (``Pacer``) and reports what the driver reads (``TTS_TRIAL`` lines).

Each worker calls ``Pacer.micro`` at the start of every micro-batch's training step (``training_step``,
``compute_loss``, the body of ``accumulate``) and spends the busy time it returns after the forward,
where a real model's compute is. The busy time is calibrated in the job as in the plain benchmark:
``WARMUP`` optimizer steps with none, then ``(T - median real step) / ACCUM`` per micro-batch, so an
optimizer step lasts ``T`` (10 s: 8 micro-batches of 1.25 s in the full run). Whatever an adapter does
at a notice (act at the next optimizer step, or between two micro-batches), the pacing is the same.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks._util import busy
from benchmarks.time_to_safe import AFTER, DEADLINE_S, LAYERS, TRIAL_PREFIX, WARMUP, _emit, _wait_subscribed

FRAMEWORKS = ("lightning", "hf", "accelerate")
ACCUM = int(os.environ.get("SG_TTS_ACCUM", "8"))  # time_to_safe.py --accum (1: no accumulation)
STEPS = WARMUP + 1 + AFTER  # optimizer steps a job may run: the warm-up, the one with the notice, AFTER more


def _dim(state_mib: float) -> int:
    """Side of the square layers: fp32 param + exp_avg + exp_avg_sq = 12 B per parameter."""
    return max(8, int(math.sqrt(state_mib * 2**20 / 12 / LAYERS)))


def _net(dim: int) -> Any:
    import torch

    torch.manual_seed(0)  # identical initial weights on every rank
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)])


def _schedule(opt: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))


def _state_bytes(opt: Any) -> int:
    """Parameters + every tensor of their optimizer state (the AdamW moments), this rank's copy."""
    import torch

    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            total += p.numel() * p.element_size()
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
    return total


class Pacer:
    """Paces a framework's micro-batches, sends the drill at a random phase of one optimizer step, reports.

    Called at the start of every training micro-batch on every rank (the frameworks run ``ACCUM`` of them
    per optimizer step, micro-batch 0 first), with the optimizer steps completed so far.
    """

    def __init__(self, *, rank: int, world: int, period: float, phase: float, sock: str,
                 optimizer: Callable[[], Any]) -> None:
        self.rank, self.world, self.period, self.phase, self.sock = rank, world, period, phase, sock
        self.optimizer = optimizer  # the torch optimizer, once the framework has built it
        self.started = 0  # micro-batches started
        self.done = 0  # optimizer steps completed at the latest micro-batch
        self.micro_idx = 0
        self.sleep_s = 0.0
        self.paced = False
        self.step_starts: list[float] = []
        self.info: dict[str, Any] = {"phase": phase, "accumulate": ACCUM}

    def micro(self, done: int) -> float:
        """A micro-batch starts: its busy seconds (0 during the warm-up)."""
        k = self.started % ACCUM
        self.started += 1
        self.done, self.micro_idx = done, k
        now = time.perf_counter()
        if k == 0:
            if self.paced and self.rank == 0:
                _emit(TRIAL_PREFIX, {"iteration_s": round(now - self.step_starts[-1], 4), "done": done})
            self.step_starts.append(now)
            if not self.paced and done >= WARMUP:
                self._calibrate()
        if self.paced and self.rank == 0:
            _emit(TRIAL_PREFIX, {"micro_start": time.time(), "step": done, "micro": k})
        return self.sleep_s

    def _calibrate(self) -> None:
        """End of the warm-up: the busy time per micro-batch, then (rank 0) the drill's timer."""
        import torch
        import torch.distributed as dist

        steps = [b - a for a, b in zip(self.step_starts, self.step_starts[1:])]
        real = torch.tensor([statistics.median(steps[1:] or steps)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(real, op=dist.ReduceOp.MAX)
        self.sleep_s = max(0.0, (self.period - float(real[0])) / ACCUM)
        if self.rank == 0:
            _wait_subscribed(self.sock, self.world)
        if self.world > 1:
            dist.barrier()
        self.paced = True
        self.step_starts[-1] = time.perf_counter()
        if self.rank != 0:
            return
        self.info.update(real_part_s=round(float(real[0]), 4), sleep_s=round(self.sleep_s, 4),
                         state_bytes=_state_bytes(self.optimizer()))
        threading.Thread(target=self._send, args=(time.time(),), daemon=True).start()

    def _send(self, t_step: float) -> None:
        from spotguard.daemon.client import request_sync
        from spotguard.protocol import Drill, DrillOk

        time.sleep(max(0.0, t_step + self.phase * self.period - time.time()))
        self.info["completed_at_send"] = self.done
        self.info["micro_at_send"] = self.micro_idx
        self.info["t_sent"] = time.time()
        reply = request_sync(self.sock, Drill(kind="preemption", deadline_in=DEADLINE_S), timeout=10.0)
        self.info["notice_id"] = reply.id if isinstance(reply, DrillOk) else None
        _emit(TRIAL_PREFIX, self.info)


def _finished(rank: int) -> None:
    """The loop (``STEPS`` optimizer steps) ended without a preemption: say so and leave (no teardown to hang in)."""
    _emit(TRIAL_PREFIX, {"error": f"rank {rank} still training {AFTER} steps after the notice"})
    sys.stdout.flush()
    os._exit(3)


# ----------------------------------------------------------------------------------------- frameworks

def _lightning(cfg: dict[str, Any]) -> None:
    import torch

    try:
        import lightning.pytorch as pl
    except ImportError:  # the older package name works the same
        import pytorch_lightning as pl  # type: ignore[no-redef]

    from spotguard import install_preemption_hook

    dim, rank = cfg["dim"], int(os.environ["RANK"])

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(dim)
            self.x = torch.randn(4, dim)
            self.pacer = Pacer(optimizer=lambda: self.trainer.optimizers[0], **cfg["pacer"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            busy_s = self.pacer.micro(int(self.trainer.global_step))
            out = self.net(self.x)
            busy(busy_s)
            return out.square().mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-4)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _schedule(opt), "interval": "step"}}

    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=1, strategy="ddp",
        accumulate_grad_batches=ACCUM, max_steps=STEPS, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False,
    )
    install_preemption_hook(trainer, storage=cfg["storage"])
    trainer.fit(Net(), train_dataloaders=torch.utils.data.DataLoader(torch.arange(ACCUM * (STEPS + 1)), batch_size=1))
    _finished(rank)


def _hf(cfg: dict[str, Any]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import torch
    from transformers import Trainer, TrainingArguments

    from spotguard import install_preemption_hook

    dim, rank = cfg["dim"], int(os.environ["RANK"])
    per_device = 4

    class Model(torch.nn.Module):
        """A plain module the way the Trainer takes one: keyword inputs in, ``{"loss": ...}`` out."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _net(dim)

        def forward(self, x: Any) -> dict[str, Any]:
            out = self.net(x)
            busy(self.busy_s)  # set by compute_loss for this micro-batch
            return {"loss": out.square().mean()}

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n, self.x = n, torch.randn(dim)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": self.x}

    class PacedTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
            inner = model.module if hasattr(model, "module") else model
            inner.busy_s = pacer.micro(int(self.state.global_step))
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)

    args = TrainingArguments(
        output_dir=cfg["storage"] + "-out", per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-4, optim="adamw_torch",
        lr_scheduler_type="linear", logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
        remove_unused_columns=False, seed=0,
    )
    model = Model()
    model.busy_s = 0.0
    world = int(os.environ["WORLD_SIZE"])
    trainer = PacedTrainer(model=model, args=args, train_dataset=Rows(per_device * world * ACCUM * (STEPS + 1)))
    pacer = Pacer(optimizer=lambda: trainer.optimizer, **cfg["pacer"])
    install_preemption_hook(trainer, storage=cfg["storage"])
    trainer.train()
    _finished(rank)


def _accelerate(cfg: dict[str, Any]) -> None:
    import torch
    from accelerate import Accelerator

    from spotguard import install_preemption_hook

    dim = cfg["dim"]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    net = _net(dim)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model, opt, sched = accelerator.prepare(net, opt, _schedule(opt))
    hook = install_preemption_hook(accelerator, storage=cfg["storage"])
    assert hook.resume() == 0
    pacer = Pacer(optimizer=lambda: opt.optimizer, **cfg["pacer"])
    x = torch.randn(4, dim)
    done = 0
    for _ in range(ACCUM * STEPS):
        with accelerator.accumulate(model):
            busy_s = pacer.micro(done)
            out = model(x)
            busy(busy_s)
            accelerator.backward(out.square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            done += 1
    _finished(accelerator.process_index)


def worker() -> None:
    """One trial's rank (``time_to_safe.py --worker framework``): the framework named by ``SG_TTS_FRAMEWORK``."""
    import torch

    torch.set_num_threads(1)
    fw = os.environ["SG_TTS_FRAMEWORK"]
    cfg: dict[str, Any] = {
        "dim": _dim(float(os.environ["SG_TTS_STATE_MIB"])),
        "storage": os.environ["SG_TTS_STORAGE"],
        "pacer": {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                  "period": float(os.environ["SG_TTS_ITER_S"]), "phase": float(os.environ["SG_TTS_PHASE"]),
                  "sock": os.environ["SPOTGUARD_SOCKET"]},
    }
    run: Optional[Callable[[dict[str, Any]], None]] = {"lightning": _lightning, "hf": _hf,
                                                       "accelerate": _accelerate}.get(fw)
    if run is None:
        raise SystemExit(f"unknown framework {fw!r}: one of {', '.join(FRAMEWORKS)}")
    Path(cfg["storage"]).mkdir(parents=True, exist_ok=True)
    run(cfg)
