"""One process, no torch.distributed (a one-GPU spot VM): a tiny GPT-2 under ``transformers.Trainer`` with spotguard,
then ``AFTER`` seconds of the user's own work after ``trainer.train()`` returned (test_hf_anymoment.py).

Prints ``{"step": k}`` at each training micro-batch (after ``STEP_S`` seconds of it), ``{"trained": N}`` once
``train()`` returned and ``{"done": 1}`` at the end. Storage: ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from spotguard import install_preemption_hook  # noqa: E402


class Paced(Trainer):
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
        print(json.dumps({"step": self.state.global_step}), flush=True)
        time.sleep(float(os.environ.get("STEP_S", "0")))
        return out


class Meter(TrainerCallback, ExportableState):
    """A user's stateful callback (``METER=1``): the steps begun, in ``trainer_state.json``'s stateful_callbacks."""

    def __init__(self, steps: int = 0) -> None:
        self.steps = steps

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.steps += 1
        return control

    def state(self) -> dict[str, Any]:
        return {"args": {"steps": self.steps}, "attributes": {}}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0)
    data = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 40
    args = TrainingArguments(output_dir=sys.argv[1] + "-out", max_steps=int(os.environ.get("STEPS", "2")),
                             per_device_train_batch_size=2, save_strategy="no", logging_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True)
    trainer = Paced(model=GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                    callbacks=[Meter()] if os.environ.get("METER") == "1" else None)
    hook = install_preemption_hook(trainer, storage=sys.argv[1])
    trainer.train(resume_from_checkpoint=hook.latest())
    print(json.dumps({"trained": trainer.state.global_step}), flush=True)
    time.sleep(float(os.environ.get("AFTER", "0")))  # the user's own work after training (an export, an upload)
    print(json.dumps({"done": 1}), flush=True)


if __name__ == "__main__":
    main()
