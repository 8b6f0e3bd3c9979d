"""Accelerate with gradient accumulation over a prepared, shuffled DataLoader (review of issue 23's accumulation):
``for epoch: for batch in loader: with accelerator.accumulate(model)``, as Accelerate's examples write it.

152 samples, batch 8, 2 ranks: 10 batches a rank an epoch (``even_batches``: rank 1's last one wraps around), and
``gradient_accumulation_steps=4``: Accelerate forces a sync at the loader's last batch
(``GradientState.end_of_dataloader``), so an epoch is 3 optimizer steps of 4, 4 and 2 micro-batches and
``accelerator.step`` is reset to 0 there. An oracle iteration is one optimizer step. ``clip_grad_norm_`` only when
``sync_gradients``; ``opt.step()``/``sched.step()`` on every micro-batch. The resume continues at optimizer step
``start``: epoch ``start // 3``, ``accelerator.skip_first_batches(loader, (start % 3) * 4)`` (the docstring's
``(start * N) % len(loader)`` is wrong here: len 10 is not a multiple of 4).

``EXO_AAL_SEEDABLE=0``: Accelerate's default ``DataLoaderConfiguration`` (``use_seedable_sampler=False``): the
shuffle draws from the sampler's ``synchronized_generator``, which ``save_state`` does not save.
``EXO_AAL_MP``: mixed precision (default ``no``). ``EXO_AAL_SPLIT=1``: ``split_batches=True`` (batch 16 split).
``EXO_AAL_EVEN=0``: ``even_batches=False``: rank 1 gets 9 batches an epoch (its last accumulation 1 micro-batch
where rank 0's is 2; DDP is fine: each rank syncs 3 times an epoch). ``EXO_AAL_OWN=K``: the user's own ``accelerator.save_state()`` every K micro-batches (counted over the run, as
Accelerate's examples count ``checkpointing_steps``), with ``automatic_checkpoint_naming`` and ``total_limit=2`` into
a project folder beside the hook's store (it outlives the process, as a persistent disk does): Accelerate's
``project_configuration.iteration`` (the next ``checkpoint_<n>``) is training state too (phase ``ownsave``).
``EXO_AAL_STREAM=1`` (review obrev): an ``IterableDataset`` with its own ``generator``, ``dispatch_batches=False``
(each rank iterates it; Accelerate synchronises the generator across ranks: its ``synchronized_generator``) that draws each epoch's order and each sample's noise; the resumed
run's ``skip_first_batches`` iterates the skipped batches from the freshly seeded generator, as the first epoch
drew them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

from _common import Net, _rt, setup
from spotguard import install_preemption_hook

setup(distributed=False)
N = 4
SEEDABLE = os.environ.get("EXO_AAL_SEEDABLE", "1") == "1"
SPLIT = os.environ.get("EXO_AAL_SPLIT") == "1"
EVEN = os.environ.get("EXO_AAL_EVEN", "1") == "1"
OWN = int(os.environ.get("EXO_AAL_OWN", "0"))
STREAM = os.environ.get("EXO_AAL_STREAM") == "1"
project = ProjectConfiguration(project_dir=_rt.storage().removeprefix("file://").rstrip("/") + "-own",
                               automatic_checkpoint_naming=True, total_limit=2) if OWN else None
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=N, mixed_precision=os.environ.get("EXO_AAL_MP", "no"),
                          dataloader_config=DataLoaderConfiguration(use_seedable_sampler=SEEDABLE,
                                                                    split_batches=SPLIT, even_batches=EVEN,
                                                                    dispatch_batches=False if STREAM else None),
                          project_config=project)
rank = accelerator.process_index
torch.manual_seed(0)
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
gd = torch.Generator().manual_seed(1234)
xs = torch.randn(152, 16, generator=gd)


class Stream(torch.utils.data.IterableDataset):
    """152 samples in an order and with noise drawn from the dataset's own generator (``EXO_AAL_STREAM``)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(4321)

    def __len__(self) -> int:
        return len(xs)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for j in torch.randperm(len(xs), generator=self.generator).tolist():
            yield xs[j] + 0.05 * torch.randn(16, generator=self.generator), xs[j].sum(dim=0, keepdim=True) * 0.1


if STREAM:
    loader = DataLoader(Stream(), batch_size=16 if SPLIT else 8)
else:
    loader = DataLoader(TensorDataset(xs, xs.sum(dim=1, keepdim=True) * 0.1), batch_size=16 if SPLIT else 8,
                        shuffle=True)
model, opt, sched, loader = accelerator.prepare(net, opt, sched, loader)
torch.manual_seed(1 + rank)
state = {"model": model, "optimizer": opt, "scheduler": sched, "accelerator_step": lambda: accelerator.step,
         **({"own_iteration": lambda: accelerator.project_configuration.iteration} if OWN else {})}
hook = install_preemption_hook(accelerator, storage=_rt.storage())
start = hook.resume()
_rt.resumed(hook, start, state)
spe = -(-len(loader) // N)  # optimizer steps an epoch: the last accumulation is cut short by the loader's end
model.train()
i, steps = start, _rt.steps()
first_epoch, k = divmod(start, spe)
for epoch in range(first_epoch, 100):
    if i >= steps:
        break
    loader.set_epoch(epoch)
    src = accelerator.skip_first_batches(loader, k * N) if epoch == first_epoch and k else loader
    _rt.begin_iteration(i)
    for b, (x, y) in enumerate(src, start=k * N if epoch == first_epoch else 0):
        _rt.phase("load")
        with accelerator.accumulate(model):
            _rt.phase("fwd")
            loss = F.mse_loss(model(x).float(), y)
            _rt.phase("bwd")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                _rt.phase("prestep")
            else:
                _rt.phase("micro")
            opt.step()
            sched.step()
            opt.zero_grad()
        if OWN and (epoch * len(loader) + b + 1) % OWN == 0:
            _rt.phase("ownsave")
            accelerator.save_state()
        if accelerator.sync_gradients:
            _rt.phase("after")
            _rt.end_iteration(i, state)
            i += 1
            if i >= steps:
                break
            _rt.begin_iteration(i)
_rt.finished(state, steps)
accelerator.end_training()
