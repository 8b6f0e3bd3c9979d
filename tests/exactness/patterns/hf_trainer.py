"""Hugging Face ``transformers.Trainer`` on 2 ranks (DDP over gloo, CPU): ``install_preemption_hook(trainer)``,
``gradient_accumulation_steps=2``, a tiny torch model with dropout that returns ``{"loss": ...}``, AdamW + StepLR
handed to the Trainer (``optimizers=``), python/numpy noise in the forward, an epoch boundary inside the run.
Resume: ``trainer.train(resume_from_checkpoint=hook.latest())``.

**Iteration** = one *optimizer step* (``state.global_step`` advances by one): two micro-batches here
(``EXO_ACCUM=6``, pattern ``hf_trainer_accum6``: six, and four in an epoch's last step). Phases,
in the order the Trainer reaches them:

- ``load``: ``get_batch_samples`` (the Trainer fetches every micro-batch of a step before the first forward;
  after a resume it restores the RNG only after that fetch);
- ``fwd``: the model's forward (each micro-batch); ``bwd``: a gradient hook on the loss (the start of
  ``backward``); ``micro``: ``on_substep_end`` (a micro-batch that does not step);
- ``prestep``: ``on_pre_optimizer_step`` (after clipping); ``step``: a pre-hook on the torch optimizer;
  ``after``: ``on_optimizer_step`` (before the scheduler steps);
- the end of the iteration: ``on_step_end`` of a callback given to ``Trainer(callbacks=...)``, which runs before
  spotguard's (added at install): the scheduler has stepped, the gradients are zeroed; a checkpoint agreed at
  spotguard's ``on_step_end`` is this state (the Trainer saves it right after).

``_rt.resumed`` is recorded once the Trainer has restored everything: model, optimizer, scheduler and
``trainer_state.json`` before its epoch loop, this rank's RNG last (``_load_rng_state``: mid-epoch after fetching
the first step's batches; at an epoch start before the epoch's iterator draws the sampler's seed from the global
RNG, which the uninterrupted run does after the end of the same iteration); a fresh run records it at
``on_train_begin``. The
digest's ``position`` is the Trainer's ``global_step`` and ``epoch``; its data position follows from them (it
skips the batches of the current epoch already trained on; the sampler is seeded by ``args.seed``).
"""

from __future__ import annotations

import os
import random
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from _common import Net, _rt, setup  # noqa: E402
from spotguard import install_preemption_hook  # noqa: E402

rank = int(os.environ.get("RANK", "0"))
AUGMENT = os.environ.get("EXO_AUGMENT") in ("1", "collate")  # review of issue 23: random augmentation in __getitem__
# review (obrev): the augmentation drawn in the collator instead (as DataCollatorForLanguageModeling's masking)
COLLATE = os.environ.get("EXO_AUGMENT") == "collate"
OWN_SAVES = os.environ.get("EXO_OWN_SAVES") == "1"  # review of issue 23: the Trainer's own logging + saves
METER = os.environ.get("EXO_METER") == "1"  # review of issue 23: a stateful callback (ExportableState)
setup(distributed=False)  # TrainingArguments creates the process group itself


class Model(torch.nn.Module):
    """A tiny regression model in the Trainer's contract: keyword inputs, ``{"loss", "logits"}`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        _rt.phase("fwd")
        x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * random.random()
        out = self.net(x)  # dropout draws from the global torch RNG
        loss = F.mse_loss(out, labels)
        if loss.requires_grad:
            loss.register_hook(_on_backward)
        return {"loss": loss, "logits": out}


def _on_backward(grad: torch.Tensor) -> None:
    _rt.phase("bwd")


class Samples(torch.utils.data.Dataset):
    """80 fixed samples: 2 ranks x 4 x 2 micro-batches = 16 a step, so an epoch is 5 iterations."""

    def __init__(self, n: int = 80) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) * 0.1 + torch.randn(n, 1, generator=g) * 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if AUGMENT and not COLLATE:  # a user's augmentation in the main process (dataloader_num_workers=0): the global torch RNG
            return {"x": self.x[i] + 0.05 * torch.randn(16), "labels": self.y[i]}
        return {"x": self.x[i], "labels": self.y[i]}


def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator drawing from the global torch RNG after the dataset's fetch (``EXO_AUGMENT=collate``)."""
    batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
    batch["x"] = batch["x"] + 0.05 * torch.randn_like(batch["x"])
    return batch


_resumed = False


def _record_resumed(step: int) -> None:
    global _resumed
    if not _resumed:
        _resumed = True
        _rt.resumed(hook, step, digest_state())


class PhaseTrainer(Trainer):
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        _rt.begin_iteration(self.state.global_step)
        if AUGMENT and RESUME is not None:  # resumed mid-epoch: this fetch draws the augmentation's noise, so the
            _record_resumed(self.state.global_step)  # RNG must be the uninterrupted run's before it (the
            # Trainer's _load_rng_state comes after it; at an epoch start it came first and recorded)
        _rt.phase("load")
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _load_rng_state(self, checkpoint: Any) -> None:
        """A resumed run: the RNG is the last thing the Trainer restores (mid-epoch after fetching the step's
        batches, at an epoch start before the epoch's iterator draws its sampler seed): record it here."""
        super()._load_rng_state(checkpoint)
        if checkpoint is not None:
            _record_resumed(self.state.global_step)


class Phases(TrainerCallback):
    """Phases and the iteration's end; runs before spotguard's callback (added later)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if RESUME is None:  # a fresh run: nothing to restore
            _record_resumed(state.global_step)
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        _rt.begin_iteration(state.global_step)
        return control

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        _rt.phase("micro")
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        _rt.phase("prestep")
        return control

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        _rt.phase("after")
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        _rt.end_iteration(state.global_step - 1, digest_state())
        return control


class Meter(TrainerCallback, ExportableState):
    """A user's stateful callback (saved in trainer_state.json, restored with
    ``restore_callback_states_from_checkpoint``): steps begun and micro-batches seen."""

    def __init__(self, steps: int = 0, micro: int = 0) -> None:
        self.steps, self.micro = steps, micro

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.steps += 1
        return control

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.micro += 1
        return control

    def state(self) -> dict[str, Any]:
        return {"args": {"steps": self.steps, "micro": self.micro}, "attributes": {}}


def meter_state() -> dict[str, int]:
    """The Meter the Trainer holds now (a resume replaces the instance)."""
    m = [c for c in trainer.callback_handler.callbacks if isinstance(c, Meter)]
    return {"steps": m[0].steps, "micro": m[0].micro} if m else {}


torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
_rt.inside_step(opt)
targs = TrainingArguments(
    output_dir=os.environ.get("EXO_OUT", "exo") + "-hf-out", per_device_train_batch_size=4,
    gradient_accumulation_steps=int(os.environ.get("EXO_ACCUM", "2")), max_steps=_rt.steps(),
    logging_strategy="steps" if OWN_SAVES else "no", logging_steps=1, save_strategy="steps" if OWN_SAVES else "no",
    save_steps=2, max_grad_norm=0.05 if OWN_SAVES else 1.0,
    report_to=[], disable_tqdm=True, seed=0, use_cpu=True, ddp_backend="gloo",
    ddp_find_unused_parameters=False, dataloader_num_workers=0, restore_callback_states_from_checkpoint=METER,
    # review (obrev): Accelerate's default shuffle (the sampler's own generator, not args.seed per epoch)
    **({"accelerator_config": {"use_seedable_sampler": False}} if os.environ.get("EXO_HF_UNSEEDABLE") == "1" else {}),
)
trainer = PhaseTrainer(model=model, args=targs, train_dataset=Samples(), optimizers=(opt, sched),
                       data_collator=collate if COLLATE else None,
                       callbacks=[Phases(), Meter()] if METER else [Phases()])
# the Trainer seeded every rank alike (set_seed(args.seed)): per-rank streams, as a user's augmentation has
random.seed(100 + rank)
np.random.seed(100 + rank)
torch.manual_seed(1 + rank)


def digest_state() -> dict[str, Any]:
    """What a resume must restore: weights, optimizer, scheduler, the Trainer's position (RNG: ``_rt``)."""
    return {"model": model, "optimizer": opt, "scheduler": sched,
            "position": lambda: {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
                                 **({"meter": meter_state()} if METER else {})}}


hook = install_preemption_hook(trainer, storage=_rt.storage())
RESUME = hook.latest()
trainer.train(resume_from_checkpoint=RESUME)
_rt.finished(digest_state(), _rt.steps())
if torch.distributed.is_initialized():  # the Trainer leaves its group alive (examples/_dist.py says why)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
