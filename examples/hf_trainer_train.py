"""Hugging Face Trainer + spotguard: a tiny GPT-2 built from a config (nothing downloaded), DDP/gloo on CPU.

The spotguard lines::

    hook = install_preemption_hook(trainer, storage=...)
    trainer.train(resume_from_checkpoint=hook.latest())

On a notice (daemon, SIGTERM, SIGUSR1) every rank stops at the same step, the
Trainer writes its checkpoint, spotguard uploads and commits it as
``<storage>/step-N/`` and ``trainer.train`` raises ``spotguard.Preempted``
(exit 143). The restarted job resumes from it: model, optimizer, scheduler,
RNG and data position.

Run::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_train.py --steps 30 --storage /tmp/ckpt-hf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of random token ids (fixed by ``seed``); labels = inputs (causal LM)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LoggingTrainer(Trainer):
    """Prints every micro-batch's loss exactly (``float.hex``) on rank 0, and sleeps ``step_time`` (simulated work)."""

    step_time = 0.0
    eval_step_time = 0.0
    _eval_batch = 0

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        self._eval_batch = 0
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        """One evaluation batch: printed on rank 0, ``eval_step_time`` long (a slow evaluation set)."""
        if self.is_world_process_zero():
            print(json.dumps({"eval_batch": self._eval_batch, "step": self.state.global_step}), flush=True)
        self._eval_batch += 1
        if self.eval_step_time > 0:
            time.sleep(self.eval_step_time)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        loss = out[0] if return_outputs else out
        if self.is_world_process_zero() and model.training:
            v = float(loss.detach())
            print(json.dumps({"step": self.state.global_step, "loss": v, "hex": v.hex()}), flush=True)
        if self.step_time > 0:
            time.sleep(self.step_time)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--storage", default=None)
    p.add_argument("--every", default=None, help="safety-net checkpoints, e.g. 15m (default: none)")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--out", default=None, help="rank 0 writes the final model+optimizer state here")
    p.add_argument("--no-hook", action="store_true", help="uninterrupted reference run without spotguard")
    p.add_argument("--output-dir", default=None, help="the Trainer's own output_dir (default: a temp folder)")
    p.add_argument("--jit", action="store_true", help="also set enable_jit_checkpoint (spotguard switches it off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--deepspeed", type=int, default=None, metavar="STAGE", help="TrainingArguments(deepspeed=...) "
                   "with this ZeRO stage")
    p.add_argument("--save-only-model", action="store_true",
                   help="TrainingArguments(save_only_model=True): the Trainer's own saves hold the weights only")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (--step-time is per "
                   "micro-batch; 12 micro-batches an epoch)")
    p.add_argument("--eval-every", type=int, default=6, help="evaluate every N steps (with --eval-batches)")
    p.add_argument("--eval-batches", type=int, default=0, help="evaluation batches (default 0: no evaluation)")
    p.add_argument("--eval-step-time", type=float, default=0.0, help="seconds each evaluation batch takes")
    p.add_argument("--save-steps", type=int, default=0, help="the Trainer's own checkpoint every N steps (default 0: "
                   "none; a reference for what spotguard's checkpoint of a step must hold)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)  # tiny, from config only
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(cfg)
    train = Tokens(96, 16, cfg.vocab_size, args.seed)  # 2 ranks x 4 = 8 a step: 12 steps an epoch
    evaluation: dict[str, Any] = {}
    evalset = None
    if args.eval_batches > 0:  # a notice during evaluation is acted on at once (docs/frameworks.md)
        evalset = Tokens(2 * 4 * args.eval_batches, 16, cfg.vocab_size, args.seed + 1)
        evaluation = {"eval_strategy": "steps", "eval_steps": args.eval_every, "per_device_eval_batch_size": 4}

    ds: dict[str, Any] = {}
    if args.deepspeed is not None:  # the Trainer's deepspeed= config (ZeRO on CPU: DS_ACCELERATOR=cpu)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ds = {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                            "zero_optimization": {"stage": args.deepspeed}, "steps_per_print": 10**9}}
    targs = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf-out-"),
        per_device_train_batch_size=4, gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=5e-3,
        lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.01,
        logging_strategy="no", save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to=[], disable_tqdm=True,
        seed=args.seed, use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
        enable_jit_checkpoint=args.jit, save_only_model=args.save_only_model, **evaluation, **ds,
    )
    trainer = LoggingTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evalset)
    trainer.step_time = args.step_time
    trainer.eval_step_time = args.eval_step_time

    resume = None
    if not args.no_hook:
        from spotguard import install_preemption_hook

        hook = install_preemption_hook(trainer, storage=args.storage, every=args.every)  # <- the spotguard line
        resume = hook.latest()
    trainer.train(resume_from_checkpoint=resume)

    if args.out and trainer.is_world_process_zero():
        torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "steps": trainer.state.global_step}, args.out)
    from _dist import leave_process_group  # examples/_dist.py, next to this script

    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
