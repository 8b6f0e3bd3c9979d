"""The exactness oracle: every committed checkpoint equals the uninterrupted run at its step.

For one loop pattern (a script in ``patterns/``): a **reference** run with no notice records the digest of
the whole training state at the end of every iteration (``_rt.py``). A **trial** gets one notice (kind
termination, source signal or drill, deadline 20-30 s; under DDP on one random rank only, as a daemon drill
reaching one node) at a uniformly random moment of the loop, or when the loop enters a chosen phase. After
the trial exits, the storage says what was committed; a **resume** run of the same script then records the
state right after ``hook.resume()`` and at the end. Verdict, exactly one of:

- ``exact``: a checkpoint of step S committed by the trial; the resumed state equals the reference at S,
  item by item, on every rank; the resumed run's final state equals the reference's final state; the trial
  exited with the hook's "nothing lost" code.
- ``honest-no-commit``: nothing committed and the exit says so (75 with ``checkpoint_failed``/``peers_lost``,
  or 143 ``nothing_to_save`` with no iteration trained or none that took an optimizer step — a loop that skipped
  every step so far has its initial weights, and a restart from nothing is the same run), or the run finished with the reference's final state,
  logging ``notice_after_last_step`` (the notice came too late to act before its last step).
- ``limitation-warned`` (only a pattern with ``Pattern.limitation``, a documented limitation of the hook): the
  trial is as ``exact`` asks, but the resume is not, for the documented reason; it holds only if the hook logged
  the limitation's warning event before the notice's commit and the committed checkpoint itself equals the
  reference at the end of an iteration at its step (``_limitation``). Counted apart: never as ``exact``.
- ``wrong``: anything else (a differing item is named; a hang; a crash; 143 "nothing lost" with nothing
  committed after trained iterations).

Every committed checkpoint is checked, not only the newest: with ``every=`` (pattern ``ddp_every``) a periodic
checkpoint committed before the notice, or finished while it was handled, is resumed from a copy of the storage
that ends at it. An ordinary notice (kind ``rebalance``/``maintenance``; SPEC: "the hook takes an ordinary
checkpoint, keeps training") is judged by ``_judge_ordinary``: the run must train to its end, exit 0 and end
bitwise at the reference's final state; its checkpoint, if committed, is ``exact`` as above; nothing committed is
``honest-no-commit`` only when the hook logged why (``notice_after_last_step``, ``checkpoint_failed``,
``checkpoint_skipped``).

Run ``python -m tests.exactness.oracle --help`` (``make exactness``); ``test_oracle.py`` is the short version.
Whatever ``spotguard`` is first on ``PYTHONPATH`` is what is tested.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
VERDICTS = ("exact", "honest-no-commit", "limitation-warned", "wrong")
NOTHING_LOST = 143
# How ranks > 1 are started: "torchrun" (its agent, as users run it; `make exactness`), "direct" (one
# process per rank with torchrun's environment: one torch import less per run) or "zygote" (as "direct", every
# process, one-rank runs too, forked from a server that imported torch once: ``_zygote.py``; the short version).
LAUNCHER = os.environ.get("EXO_LAUNCHER", "torchrun")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Pattern:
    """One loop pattern: its script, ranks, iterations, the phases its loop has, and extra environment."""

    name: str
    script: str
    nproc: int = 2
    steps: int = 10
    phases: tuple[str, ...] = ("load", "fwd", "bwd", "prestep", "step", "after")
    env: tuple[tuple[str, str], ...] = ()
    what: str = ""
    # resume from every committed checkpoint (False: the notice's own only — for a pattern that commits a
    # periodic checkpoint at nearly every step; its other commits are the periodic path's, not the notice's)
    check_all: bool = True
    # a known, reproduced failure of the hook not fixed yet (why): left out of the default matrix so that
    # `make exactness` keeps meaning "0 wrong" for everything else; `--patterns NAME` runs it (and fails)
    open_bug: str = ""
    # a documented limitation (why), in the default matrix: a trial whose resume is inexact for it is judged
    # ``limitation-warned`` (``_limitation``: the hook's warning event ``warned`` came before the commit, the
    # checkpoint equals the reference at its step) instead of ``exact``; without the warning it is ``wrong``
    limitation: str = ""
    warned: str = ""


# DeepSpeed on CPU, its comm op prebuilt once by `make deepspeed-tools` (never rebuilt per run)
_DS_ENV: tuple[tuple[str, str], ...] = (
    ("DS_ACCELERATOR", "cpu"),
    ("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch-extensions")))

PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    Pattern("ddp", "ddp.py", what="DDP 2 ranks, dropout, AdamW, StepLR, eval every 4th iteration",
            phases=("load", "fwd", "bwd", "prestep", "step", "after", "eval")),
    Pattern("single", "single.py", nproc=1, what="one process, no torch.distributed",
            phases=("load", "fwd", "bwd", "prestep", "step", "after", "eval")),
    Pattern("accum", "accum.py", what="DDP, 4 micro-batches per step (no_sync)",
            phases=("load", "micro", "prestep", "step", "after")),
    Pattern("scaler", "scaler.py", what="DDP + CPU GradScaler overflowing at iterations 1, 5, 9",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    Pattern("ema_swap", "ema_swap.py", what="torch_ema-style EMA swapped in (param.data.copy_) for eval",
            phases=("load", "fwd", "bwd", "step", "after", "eval")),
    Pattern("swa", "swa.py", what="swa_utils.AveragedModel updated after opt.step(), before the scheduler",
            phases=("load", "fwd", "bwd", "step", "after")),
    Pattern("specnorm", "specnorm.py", what="parametrizations.spectral_norm + BatchNorm",
            phases=("load", "fwd", "bwd", "step", "after")),
    Pattern("gan", "gan.py", what="two optimizers: D step, then G step",
            phases=("load", "fwd", "d_step", "g_step", "after")),
    # issue 23: two optimizers on the any-moment path (hook.range's boundaries prove each iteration's steps)
    Pattern("gan_range", "gan.py", env=(("EXO_LOOP", "range"),),
            what="two optimizers in hook.range: D step, then G step", phases=("load", "fwd", "d_step", "g_step", "after")),
    Pattern("gan_ncritic", "gan.py", env=(("EXO_LOOP", "range"), ("EXO_NCRITIC", "3")),
            what="WGAN-style n_critic in hook.range: D 3 times (own batches), then G once",
            phases=("load", "fwd", "d_step", "critic_load", "g_step", "after")),
    # review ganrev: D spectral_norm + SGD momentum with its scheduler right after its step, G AdamW amsgrad
    Pattern("gan_mix", "gan.py", env=(("EXO_LOOP", "range"), ("EXO_GAN_MIX", "1")),
            what="gan_range with D spectral_norm + SGD momentum (ExponentialLR right after D's step), G AdamW amsgrad",
            phases=("load", "fwd", "d_step", "g_step", "after")),
    # issue 23 review: GAN loops as written in the wild (gan_wild.py: BatchNorm G, clipping, EMA, sampling, a
    # scheduler at the iteration's top), on the any-moment path or sent back to the boundary path mid-run
    Pattern("gan_wild", "gan_wild.py", what="WGAN in hook.range: D twice (clamp_ after each), G, EMA of G, "
            "sched_d at the top, sampling every 3rd",
            phases=("load", "fwd", "d_step", "critic_load", "g_step", "after", "eval")),
    Pattern("gan_wild_every", "gan_wild.py", env=(("EXO_EVERY", "0.05"),), check_all=True,
            what="gan_wild with every=0.05 s (periodic checkpoints)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_cliptop", "gan_wild.py", env=(("EXO_GW_CLIP_TOP", "1"),),
            what="gan_wild with the original WGAN's clamp_ before each critic step's forward",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_step", "gan_wild.py", env=(("EXO_GW_LOOP", "step"),),
            what="gan_wild in a hook.resume()/hook.step() loop (its first iteration on the implicit path: a "
                 "notice in it is acted on at the first boundary, never at D's second step)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    # an own loop: n_critic D steps are one iteration (the clock's steps before another optimizer's); sched_d
    # at the iteration's end, since a scheduler at the top is every implicit loop's documented limit
    Pattern("gan_wild_own", "gan_wild.py", env=(("EXO_GW_LOOP", "own"), ("EXO_GW_SCHED_TOP", "0")),
            what="gan_wild in hook.resume() and a plain loop, D twice per iteration, sched_d at the iteration's "
                 "end (implicit: the boundary path at the next iteration's first D step)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_own_amp", "gan_wild.py", env=(("EXO_GW_LOOP", "own"), ("EXO_GW_SCHED_TOP", "0"),
                                                    ("EXO_GW_AMP", "1")),
            what="gan_wild_own with a GradScaler updated after each D and G step (the scaler's step()/update() "
                 "follow the implicit cycle rule)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    # review ganrev: periodic checkpoints in an own GAN loop (each labelled with the loop's count of iterations)
    Pattern("gan_wild_own_every", "gan_wild.py", env=(("EXO_GW_LOOP", "own"), ("EXO_GW_SCHED_TOP", "0"),
                                                      ("EXO_EVERY", "0.05")), check_all=True,
            what="gan_wild_own with every=0.05 s (periodic checkpoints at the implicit loop's iteration starts)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_gp", "gan_wild.py", env=(("EXO_GW_GP", "1"),),
            what="gan_wild with WGAN-GP's gradient penalty (autograd.grad create_graph)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_warmup", "gan_wild.py", env=(("EXO_GW_WARMUP", "2"),),
            what="gan_wild with n_critic 3 in the first 2 iterations, then 2 (back to the boundary path)",
            phases=("load", "fwd", "d_step", "g_step", "after", "eval")),
    Pattern("gan_wild_skip", "gan_wild.py", env=(("EXO_GW_SKIP", "1"),),
            what="gan_wild with D's step skipped every 4th iteration", phases=("load", "fwd", "d_step", "g_step",
                                                                              "after", "eval")),
    Pattern("sam", "sam.py", what="SAM: first_step / second_step, SAM.step() never called",
            phases=("load", "fwd", "first", "second", "after")),
    Pattern("readme", "readme.py", what="the README's script as a new user writes it (dropout, AdamW, "
            "StepLR, AveragedModel EMA, DataLoader drawing from the global RNG, hook.range)",
            phases=("load", "fwd", "bwd", "after")),
    Pattern("readme_fixed", "readme.py", env=(("EXO_LOADER_GENERATOR", "1"),),
            what="the README's script with DataLoader(generator=torch.Generator())",
            phases=("load", "fwd", "bwd", "after")),
    Pattern("accelerate", "accelerate_loop.py", what="Accelerate on 2 ranks: accelerator.backward, AdamW, "
            "StepLR; save_state's files written from the background for the last completed step (accelerate_anymoment.py)",
            phases=("load", "fwd", "bwd", "prestep", "after")),
    # issue 23 review: an Accelerate fine-tuning loop as written in the wild, every part accepted by any_moment_refusal
    Pattern("accelerate_wild", "accelerate_wild.py", what="Accelerate: BatchNorm, bf16, clip_grad_norm_, warmup "
            "LambdaLR, augmentation, eval every 3rd, the user's own save_state every 4th",
            phases=("load", "fwd", "bwd", "prestep", "after", "eval", "ownsave")),
    Pattern("accelerate_wild_loader", "accelerate_wild.py", env=(("EXO_AW_LOADER", "1"), ("EXO_AW_NORM", "ln"),
                                                                  ("EXO_AW_NOSAVE", "1")),
            what="accelerate_wild with a prepared shuffled DataLoader resumed mid-epoch by skip_first_batches "
                 "(its iterator draws a base seed from the global torch RNG), LayerNorm",
            phases=("load", "fwd", "bwd", "prestep", "after", "eval")),
    Pattern("accelerate_wild_loader_boundary", "accelerate_wild.py",
            env=(("EXO_AW_LOADER", "1"), ("EXO_AW_NORM", "ln"), ("EXO_AW_NOSAVE", "1"),
                 ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="accelerate_wild_loader on the boundary path (save_state at the next optimizer step)",
            phases=("load", "fwd", "bwd", "prestep", "after", "eval")),
    Pattern("accelerate_sched_top", "accelerate_wild.py", env=(("EXO_AW_SCHED_TOP", "1"), ("EXO_AW_NOSAVE", "1")),
            what="accelerate_wild with the scheduler stepped at the iteration's top (the pre-1.1 PyTorch order): "
                 "detected at the first optimizer step, the schedulers and lr read at S's optimizer step "
                 "(accelerate_sched.py; was saved stepped for S+1 and stepped again after the resume)",
            phases=("load", "fwd", "bwd", "prestep", "after", "eval")),
    Pattern("accelerate_sched_top_boundary", "accelerate_wild.py",
            env=(("EXO_AW_SCHED_TOP", "1"), ("EXO_AW_NOSAVE", "1"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="accelerate_sched_top on the boundary path (save_state at the next optimizer step, the schedulers "
                 "and lr loaded as at S's optimizer step for it)", phases=("load", "fwd", "bwd", "prestep", "after",
                                                                            "eval")),
    # issue 23: accelerator.accumulate over 4 micro-batches; the last completed optimizer step is written from the
    # background (accelerate_anymoment.py), the micro-batches after it thrown away
    Pattern("accelerate_accum", "accelerate_loop.py", env=(("EXO_ACCUM", "4"),), what="the accelerate pattern "
            "with gradient_accumulation_steps=4 (accelerator.accumulate; opt/sched.step() on every micro-batch)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_schedfree", "accelerate_loop.py", env=(("EXO_ACCUM", "4"), ("EXO_ACC_SCHED_FREE", "1")),
            what="the accelerate_accum pattern with step_scheduler_with_optimizer=False: the scheduler stepped after "
                 "opt.step() on every micro-batch (the first one before the first real optimizer step)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_synconly", "accelerate_loop.py", env=(("EXO_ACCUM", "4"), ("EXO_ACC_SYNC_ONLY", "1")),
            what="the accelerate_accum pattern stepping only if accelerator.sync_gradients",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_boundary", "accelerate_loop.py",
            env=(("EXO_ACCUM", "4"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="the accelerate_accum pattern on the boundary path (save_state at the next micro-batch's forward, "
                 "rewound to the last optimizer step: the path of refused configurations)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("fsdp2", "fsdp2.py", what="FSDP2 fully_shard on 2 ranks, Adam, StepLR",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    # issue 26: the notice reaches one rank; its unique shards stream to the other rank's host memory, which
    # uploads them beside its own (judged also by the record: ``writers.evacuated`` names that rank)
    Pattern("fsdp2_evac", "fsdp2.py", env=(("SPOTGUARD_EVACUATE", "always"),), what="the fsdp2 pattern with "
            "SPOTGUARD_EVACUATE=always: the doomed rank's shards evacuated to the survivor, which writes them",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    # the same under DDP: the doomed rank's unique bytes are its per-rank state only (the plan gave the replicated
    # model and optimizer to the survivor); those few kB go through the survivor too
    Pattern("ddp_evac", "ddp.py", env=(("SPOTGUARD_EVACUATE", "always"),), what="the ddp pattern with "
            "SPOTGUARD_EVACUATE=always: the doomed rank's per-rank state evacuated to the survivor, which writes it",
            phases=("load", "fwd", "bwd", "prestep", "step", "after", "eval")),
    Pattern("ddp_every", "ddp.py", env=(("EXO_EVERY", "1.0"), ("EXO_SLOW_PERIODIC", "0.8")),
            what="ddp with every=1 s and a slow store: periodic uploads (0.8 s each, in the background) "
            "in flight when notices land", phases=("load", "fwd", "bwd", "prestep", "step", "after", "eval",
                                                     "periodic", "periodic_mid")),
    Pattern("ddp_every_step", "ddp.py", env=(("EXO_EVERY", "0.05"),), check_all=False,
            what="ddp with every=0.05 s: a periodic save at nearly every other step (fast store), so one is due "
            "at the step an ordinary notice's background save stands for"),
    Pattern("lightning", "lightning_loop.py", what="Lightning Trainer on 2 ranks (DDP, gloo): accumulate_grad_batches"
            "=2, dropout, AdamW, step-interval StepLR; iteration = one optimizer step",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    # review of issue 23: a buffer that is not a normalisation layer's moves at every micro-batch's forward
    Pattern("lightning_specnorm", "lightning_loop.py", env=(("EXO_SPECNORM", "1"),), what="the lightning pattern "
            "with parametrizations.spectral_norm on fc1 (its _u/_v buffers move at each training forward)",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    Pattern("lightning_meter", "lightning_loop.py", env=(("EXO_METER", "1"),), what="the lightning pattern with "
            "a user callback whose state_dict tensor (batches seen) is updated in place at every batch's end",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    Pattern("lightning_accum4", "lightning_loop.py", env=(("EXO_ACCUM", "4"),), what="the lightning pattern with "
            "accumulate_grad_batches=4 over 10-batch epochs (4, 4, then a short 2)",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    # review of issue 23 (lrev): Lightning's WeightAveraging callback (its on_save_checkpoint moves the module's
    # state_dict to current_model_state and puts the average in state_dict) over spectral_norm's moving buffers
    Pattern("lightning_ema", "lightning_loop.py", env=(("EXO_EMA", "1"), ("EXO_SPECNORM", "1")),
            what="the lightning_specnorm pattern with Lightning's WeightAveraging callback",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    # review of issue 23 (lrev): WeightAveraging swaps the average into the module for each validation (every 2 steps,
    # right after a step's end) while the any-moment path writes that step from the background (a 1 s write)
    Pattern("lightning_valswap", "lightning_loop.py", env=(("EXO_VALSWAP", "1"), ("EXO_ACCUM", "2")),
            what="the lightning pattern with WeightAveraging, a validation every 2 steps and a slow checkpoint write",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after", "valstart")),
    # review of issue 23 (lrev): the module counts its training batches (a "tokens seen"), saved by its own
    # on_save_checkpoint / on_load_checkpoint
    Pattern("lightning_seen", "lightning_loop.py", env=(("EXO_SEEN", "1"),), what="the lightning pattern with a "
            "batch counter the module saves in its on_save_checkpoint",
            phases=("load", "micro", "step", "fwd", "bwd", "prestep", "after")),
    # issue 23: no accumulation: the any-moment path (lightning_anymoment.py), the step after S held at its
    # on_before_optimizer_step while S is written from the background
    Pattern("lightning_noaccum", "lightning_loop.py", env=(("EXO_ACCUM", "1"),), what="the lightning pattern "
            "without accumulation (one batch a step): the any-moment path",
            phases=("load", "step", "fwd", "bwd", "prestep", "after")),
    Pattern("hf_trainer_specnorm", "hf_trainer.py", env=(("EXO_ACCUM", "6"), ("EXO_SPECNORM", "1")),
            what="the hf_trainer_accum6 pattern with parametrizations.spectral_norm on fc1",
            phases=("load", "fwd", "bwd", "micro", "prestep", "step", "after")),
    Pattern("accelerate_accum_specnorm", "accelerate_loop.py", env=(("EXO_ACCUM", "4"), ("EXO_SPECNORM", "1")),
            what="the accelerate_accum pattern with parametrizations.spectral_norm on fc1",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    # review of issue 23 (arev): accumulation over a prepared shuffled DataLoader whose length (10) is not a multiple
    # of 4 (Accelerate forces a sync at its end: 4, 4, 2), resumed mid-epoch with skip_first_batches
    Pattern("accelerate_accum_loader", "accelerate_accum_loader.py", what="Accelerate, accumulation 4 over a "
            "prepared shuffled 10-batch loader (use_seedable_sampler), clip_grad_norm_, skip_first_batches",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_loader_split_bf16", "accelerate_accum_loader.py",
            env=(("EXO_AAL_SPLIT", "1"), ("EXO_AAL_MP", "bf16")),
            what="accelerate_accum_loader with split_batches=True (batch 16 split; the scheduler stepped once a "
                 "step, not once a process) and bf16 autocast", phases=("load", "fwd", "bwd", "micro", "prestep",
                                                                         "after")),
    Pattern("accelerate_accum_loader_uneven", "accelerate_accum_loader.py", env=(("EXO_AAL_EVEN", "0"),),
            what="accelerate_accum_loader with even_batches=False (rank 0: 10 batches an epoch, rank 1: 9: the "
                 "ranks' last accumulations differ in micro-batches)", phases=("load", "fwd", "bwd", "micro",
                                                                                "prestep", "after")),
    Pattern("accelerate_accum_loader_uneven_boundary", "accelerate_accum_loader.py",
            env=(("EXO_AAL_EVEN", "0"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="accelerate_accum_loader_uneven on the boundary path (an agreement at each micro-batch's forward)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_loader_own", "accelerate_accum_loader.py", env=(("EXO_AAL_OWN", "3"),),
            what="accelerate_accum_loader with the user's own save_state() every 3 micro-batches (automatic "
                 "checkpoint naming, total_limit=2)", phases=("load", "fwd", "bwd", "micro", "prestep", "after",
                                                               "ownsave")),
    Pattern("accelerate_accum_loader_own_boundary", "accelerate_accum_loader.py",
            env=(("EXO_AAL_OWN", "3"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="accelerate_accum_loader_own on the boundary path (save_state at the next micro-batch's forward)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after", "ownsave")),
    Pattern("accelerate_accum_loader_stream", "accelerate_accum_loader.py", env=(("EXO_AAL_STREAM", "1"),),
            what="accelerate_accum_loader over an IterableDataset with its own generator (order and noise drawn from "
                 "it: Accelerate's synchronized_generator, not a sampler's)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_loader_default", "accelerate_accum_loader.py", env=(("EXO_AAL_SEEDABLE", "0"),),
            what="accelerate_accum_loader with Accelerate's default DataLoaderConfiguration (use_seedable_sampler=False:"
                 " the shuffle draws from the sampler's generator, which save_state does not save: the adapter saves "
                 "it, accelerate_sampler.py)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("accelerate_accum_loader_default_boundary", "accelerate_accum_loader.py",
            env=(("EXO_AAL_SEEDABLE", "0"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="accelerate_accum_loader_default on the boundary path (save_state at the next micro-batch's forward)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "after")),
    Pattern("hf_trainer", "hf_trainer.py", what="transformers.Trainer on 2 ranks (DDP, gloo): "
            "gradient_accumulation_steps=2, dropout, AdamW + StepLR via optimizers=; iteration = one optimizer step",
            phases=("load", "fwd", "bwd", "micro", "prestep", "step", "after")),
    # issue 23: long enough an accumulation that a notice is acted on between micro-batches (rewound to the last
    # optimizer step), in a full accumulation and in the epoch's last, shorter one
    Pattern("hf_trainer_accum6", "hf_trainer.py", env=(("EXO_ACCUM", "6"),), what="the hf_trainer pattern with "
            "gradient_accumulation_steps=6: 10 micro-batches an epoch (6, then 4)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "step", "after")),
    # issue 23: no accumulation: the any-moment path (hf_anymoment.py) writes the last completed optimizer step from
    # the background while the next step's forward/backward go on (held in on_pre_optimizer_step)
    Pattern("hf_trainer_noaccum", "hf_trainer.py", steps=12, env=(("EXO_ACCUM", "1"),), what="the hf_trainer "
            "pattern without gradient accumulation: 10 steps an epoch (one micro-batch each), an epoch end at 10",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    # review of issue 23 (hfrev): the no-accumulation Trainer with a user's random augmentation in __getitem__
    # (global torch RNG, in the main process), and with the Trainer's own logging (every step), saves (every 2nd)
    # and tight gradient clipping around the notice
    Pattern("hf_trainer_augment", "hf_trainer.py", steps=12, env=(("EXO_ACCUM", "1"), ("EXO_AUGMENT", "1")),
            what="the hf_trainer_noaccum pattern with random noise added to each sample in Dataset.__getitem__ "
                 "(accelerate fetches one batch ahead: the adapter replays the RNG of the resumed run's first "
                 "fetches, hf_fetch.py)",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    Pattern("hf_trainer_augment_collate", "hf_trainer.py", steps=12, env=(("EXO_ACCUM", "1"), ("EXO_AUGMENT", "collate")),
            what="hf_trainer_augment with the noise drawn in the data collator (after the dataset's fetch), as "
                 "DataCollatorForLanguageModeling's masking draws", phases=("load", "fwd", "bwd", "prestep", "step",
                                                                            "after")),
    Pattern("hf_trainer_unseedable", "hf_trainer.py", env=(("EXO_HF_UNSEEDABLE", "1"),),
            what="the hf_trainer pattern with accelerator_config use_seedable_sampler=False (each epoch's order drawn "
                 "from the sampler's generator, which neither the Trainer's checkpoint nor the adapter saved)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "step", "after")),
    Pattern("hf_trainer_unseedable_boundary", "hf_trainer.py",
            env=(("EXO_HF_UNSEEDABLE", "1"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="hf_trainer_unseedable on the boundary path (a notice acted on at a micro-batch, rewound to S)",
            phases=("load", "fwd", "bwd", "micro", "prestep", "step", "after")),
    Pattern("hf_trainer_augment_boundary", "hf_trainer.py", steps=12,
            env=(("EXO_ACCUM", "1"), ("EXO_AUGMENT", "1"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="hf_trainer_augment on the boundary path (the Trainer's own save at on_step_end: its rng_state is "
                 "taken before the next step's fetches)", phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    Pattern("hf_trainer_augment_accum", "hf_trainer.py", env=(("EXO_AUGMENT", "1"),),
            what="hf_trainer_augment with accumulation 2 on the any-moment path (S written from the background "
                 "while S+1's micro-batches go on)", phases=("load", "fwd", "bwd", "micro", "prestep", "step",
                                                             "after")),
    Pattern("hf_trainer_augment_accum_boundary", "hf_trainer.py",
            env=(("EXO_AUGMENT", "1"), ("SPOTGUARD_BACKGROUND_AGREEMENT", "0")),
            what="hf_trainer_augment with accumulation 2 on the boundary path (a notice acted on at a micro-batch, "
                 "rewound to the last optimizer step)", phases=("load", "fwd", "bwd", "micro", "prestep", "step",
                                                                 "after")),
    Pattern("hf_trainer_own_saves", "hf_trainer.py", steps=12, env=(("EXO_ACCUM", "1"), ("EXO_OWN_SAVES", "1")),
            what="the hf_trainer_noaccum pattern with logging_steps=1, save_steps=2, max_grad_norm=0.05",
            phases=("load", "fwd", "bwd", "prestep", "step", "after")),
    Pattern("hf_trainer_meter", "hf_trainer.py", env=(("EXO_METER", "1"),), what="the hf_trainer pattern (accumulation "
            "2) with a user's stateful callback (ExportableState: steps begun, micro-batches seen), restored by "
            "restore_callback_states_from_checkpoint", phases=("load", "fwd", "bwd", "micro", "prestep", "step",
                                                                "after")),
    # review of issue 22 (rev22): loops the patterns above did not cover
    Pattern("meter", "meter.py", what="DDP + a user stateful object (running-loss meter, samples seen) updated "
            "between the forward and optimizer.step(); clip_grad_norm_, zero_grad(set_to_none=False)"),
    Pattern("plateau", "plateau.py", what="DDP + ReduceLROnPlateau stepped on the validation loss after an "
            "evaluation every 3rd iteration", phases=("load", "fwd", "bwd", "prestep", "step", "after", "eval",
                                                     "plateau")),
    Pattern("nanskip", "nanskip.py", what="DDP, corrupt (NaN) samples: optimizer.step() skipped when the gradient "
            "norm is not finite; clip_grad_norm_, LambdaLR warm-up; hook.resume() + range(start, total)",
            limitation="the implicit clock counts optimizer steps: after a skipped step hook.resume() returns steps, "
                       "not iterations, and range(start, total) re-runs iterations (exact under hook.range(): "
                       "nanskip_range); the hook logs optimizer_step_skipped with that fix at the first skip",
            warned="optimizer_step_skipped"),
    Pattern("nanskip_range", "nanskip.py", env=(("EXO_RANGE", "1"),), what="the nanskip loop under "
            "hook.range(total): the loop's iterations are the clock, a skipped step is exact"),
    Pattern("byol", "byol.py", what="DDP + a BYOL/DINO teacher in the dict soft-updated with lerp_ after the step, "
            "max-norm written in place, two param groups, clip_grad_norm_, LambdaLR warm-up"),
    # issue 29: DeepSpeed's engine (the hook acts after the engine.step() advancing global_steps)
    Pattern("deepspeed_zero2", "deepspeed_loop.py", env=_DS_ENV, what="DeepSpeed ZeRO-2 on 2 ranks: "
            "install_preemption_hook(engine), engine.backward/step, dropout, AdamW + WarmupDecayLR, add_state data",
            phases=("load", "fwd", "bwd", "prestep", "after")),
    Pattern("deepspeed_zero3", "deepspeed_loop.py", env=(*_DS_ENV, ("EXO_ZERO", "3")), what="the deepspeed_zero2 "
            "pattern under ZeRO-3 (parameters partitioned: digested as each rank's partition)",
            phases=("load", "fwd", "bwd", "prestep", "after")),
    # review of issue 29's any-moment path: loops the two patterns above did not cover
    Pattern("deepspeed_zero2_ema", "deepspeed_loop.py", env=(*_DS_ENV, ("EXO_EMA", "1")), what="the "
            "deepspeed_zero2 pattern + an EMA of the weights updated after engine.step(), given to add_state",
            phases=("load", "fwd", "bwd", "prestep", "after")),
    Pattern("deepspeed_zero2_slow", "deepspeed_loop.py", env=(*_DS_ENV, ("SPOTGUARD_TEST_SAVE_DELAY", "14"),
                                                           ("EXO_ORDINARY_DEADLINE", "12")),
            what="the deepspeed_zero2 pattern with each write taking 14 s and ordinary notices 12 s ahead (as a "
            "large ZeRO state to object storage against an AWS rebalance's 120 s): the write outlasts the deadline",
            phases=("load", "fwd", "bwd", "prestep", "after")),
    Pattern("moco", "moco.py", what="DDP + a MoCo-style momentum encoder updated in place inside the model's "
            "forward, a queue buffer enqueued in the forward"),
)}


# ---------------------------------------------------------------- one process (group)

@dataclass
class Run:
    """A finished run: exit status, its log (stdout+stderr of every process) and each rank's records."""

    returncode: Optional[int]
    timed_out: bool
    log: str
    records: dict[int, list[dict[str, Any]]]
    seconds: float
    codes: dict[int, Optional[int]] = field(default_factory=dict)  # rank -> exit code (direct launcher)

    def events(self, name: Optional[str] = None) -> list[dict[str, Any]]:
        return [e for e in json_lines(self.log) if e.get("component") == "hook"
                and (name is None or e.get("event") == name)]

    def of(self, rank: int, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records.get(rank, []) if r.get("kind") == kind]

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every JSON object in a log, also where two processes' lines ran together."""
    out: list[dict[str, Any]] = []
    dec = json.JSONDecoder()
    for raw in text.splitlines():
        i = raw.find("{")
        while 0 <= i < len(raw):
            try:
                obj, end = dec.raw_decode(raw, i)
            except json.JSONDecodeError:
                i = raw.find("{", i + 1)
                continue
            if isinstance(obj, dict):
                out.append(obj)
            i = raw.find("{", end)
    return out


class _Zygote:
    """The client of ``_zygote.py`` (started on first use, one per oracle process, shared by its threads)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pids: dict[int, int] = {}            # request id -> pid
        self._status: dict[int, int] = {}          # pid -> exit status
        self._next = 0
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py"), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=str(REPO),
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._read, name="exo-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "id" in msg:
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self._status[msg["pid"]] = msg["status"]
                self._cond.notify_all()
        with self._cond:  # the server died: every wait ends
            self._status.setdefault(-1, -1)
            self._cond.notify_all()

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log: Path) -> "_Forked":
        assert self.proc.stdin is not None
        with self._cond:
            rid = self._next
            self._next += 1
            self.proc.stdin.write((json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd,
                                               "log": str(log)}) + "\n").encode())
            self.proc.stdin.flush()
            # its first fork waits for its imports (torch, a framework: ~30 s on 2 loaded cores)
            if not self._cond.wait_for(lambda: rid in self._pids or -1 in self._status, 180):
                raise RuntimeError("the zygote did not fork within 180 s")
            if rid not in self._pids:
                raise RuntimeError("the zygote died")
            return _Forked(self, self._pids.pop(rid))

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._status or -1 in self._status, timeout)
            return self._status.get(pid, -1 if -1 in self._status else None)


class _Forked:
    """A run forked by the zygote, waited on like a ``subprocess.Popen`` (its own session: ``killpg(pid)``)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return self.returncode


_ZYGOTES: dict[tuple[str, ...], _Zygote] = {}
_ZYGOTE_LOCK = threading.Lock()
# the framework a pattern script imports: its runs fork from a server that imported it too (~3-4 CPU-s a run)
PRELOAD: dict[str, tuple[str, ...]] = {"lightning_loop.py": ("lightning.pytorch",),
                                       "hf_trainer.py": ("transformers", "transformers.trainer")}


def _zygote(script: str = "") -> _Zygote:
    """The fork server for runs of ``script`` (one per set of preloaded frameworks)."""
    preload = PRELOAD.get(script, ())
    with _ZYGOTE_LOCK:
        z = _ZYGOTES.get(preload)
        if z is None or z.proc.poll() is not None:
            z = _ZYGOTES[preload] = _Zygote(preload)
        return z


def start_servers(patterns: list[Pattern]) -> None:
    """With the zygote launcher: start now, side by side, the fork server of every framework these patterns import
    (~3-4 CPU-s of imports each), so that the first run of each does not wait for them (``_zygote`` does not
    block: a run started before a server is ready waits in ``_Zygote.start``)."""
    if LAUNCHER == "zygote":
        for script in dict.fromkeys(p.script for p in patterns):
            _zygote(script)


def launch(p: Pattern, folder: Path, tag: str, storage: Path, env: dict[str, str], timeout: float) -> Run:
    """Run the pattern's script (torchrun for > 1 rank) to its end or ``timeout``, then kill its group."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{tag}.log"
    out = folder / tag
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "SPOTGUARD_SOCKET": str(folder / "no-daemon.sock"), "EXO_OUT": str(out),
                "EXO_STORAGE": f"file://{storage}", "EXO_STEPS": str(p.steps), **dict(p.env), **env}
    script = str(HERE / "patterns" / p.script)
    if p.nproc == 1 and LAUNCHER != "zygote":
        cmds = [([sys.executable, script], {})]
    elif LAUNCHER == "torchrun":
        cmds = [([str(TORCHRUN), "--standalone", "--nproc-per-node", str(p.nproc), "--monitor-interval", "0.2",
                  script], {})]
    elif p.nproc == 1:  # "zygote", one process: as ``python script``, no torch.distributed environment
        cmds = [([sys.executable, script], {})]
    else:  # "direct"/"zygote": the ranks as torchrun would start them, without its agent (one torch import less)
        port = str(free_port())
        cmds = [([sys.executable, script], {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(p.nproc),
                                            "LOCAL_WORLD_SIZE": str(p.nproc), "GROUP_RANK": "0",
                                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                for r in range(p.nproc)]
    t0 = time.monotonic()
    timed_out = False
    procs: list[Any] = []
    with open(log, "wb") as f:
        for cmd, extra in cmds:
            if LAUNCHER == "zygote":  # its children append to the log; argv: no python
                procs.append(_zygote(p.script).start(cmd[1:], {**full_env, **extra}, str(folder), log))
                continue
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**full_env, **extra},
                                          cwd=str(folder), start_new_session=True))
        end = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    for proc in procs:  # a hang, or stray workers of a torchrun that died: the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    codes = [proc.returncode for proc in procs]
    rc = next((c for c in codes if c != 0), 0) if not timed_out else None
    records: dict[int, list[dict[str, Any]]] = {}
    for r in range(p.nproc):
        path = Path(f"{out}.rank{r}.jsonl")
        if path.exists():
            records[r] = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return Run(rc, timed_out, log.read_text(errors="replace"), records, time.monotonic() - t0,
               {r: c for r, c in enumerate(codes)} if len(procs) > 1 else {})


def committed(storage: Path) -> list[dict[str, Any]]:
    """Committed checkpoints under ``storage``, oldest first, as ``spotguard checkpoints --json`` says."""
    from spotguard.storage.listing import main as listing  # noqa: PLC0415 - the spotguard under test

    if not storage.exists():
        return []
    buf, err = io.StringIO(), io.StringIO()
    listing(argparse.Namespace(uri=f"file://{storage}", json=True, verify=False), out=buf, err=err)
    try:
        doc = json.loads(buf.getvalue())
    except json.JSONDecodeError:
        return []
    return [c for c in doc.get("checkpoints", []) if c.get("committed")]


# ---------------------------------------------------------------- reference and trials

@dataclass
class Reference:
    pattern: Pattern
    by_rank: dict[int, dict[int, dict[str, Any]]]  # rank -> completed -> record
    final: dict[int, dict[str, Any]]
    loop_seconds: float
    seconds: float


def reference(p: Pattern, folder: Path, timeout: float = 180.0) -> Reference:
    """The uninterrupted run (hook installed, no notice): the digest at the end of every iteration."""
    run = launch(p, folder, "ref", folder / "ref-ckpt", {}, timeout)
    if run.timed_out or run.returncode != 0:
        raise RuntimeError(f"reference run of {p.name} failed (rc {run.returncode}, timed out {run.timed_out}):\n"
                           f"{run.tail(40)}")
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    final: dict[int, dict[str, Any]] = {}
    for r in range(p.nproc):
        recs = run.records.get(r, [])
        by_rank[r] = {x["completed"]: x for x in recs if x["kind"] in ("resumed", "iter")}
        fin = [x for x in recs if x["kind"] == "final"]
        if len(by_rank[r]) != p.steps + 1 or not fin:
            raise RuntimeError(f"reference run of {p.name}: rank {r} recorded {sorted(by_rank[r])}, final {bool(fin)}")
        final[r] = fin[0]
    r0 = run.records[0]
    loop = r0[-1]["t"] - r0[0]["t"]
    return Reference(p, by_rank, final, loop, run.seconds)


def differing(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Names of the items (and first-level keys) whose digests differ."""
    out: list[str] = []
    for k in sorted(set(want["items"]) | set(got["items"])):
        if want["items"].get(k) == got["items"].get(k):
            continue
        ws, gs = want.get("sub", {}).get(k, {}), got.get("sub", {}).get(k, {})
        keys = sorted(kk for kk in set(ws) | set(gs) if ws.get(kk) != gs.get(kk))
        out.append(f"{k}[{', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}]" if keys else k)
    return out


@dataclass
class Trial:
    pattern: str
    notice: str                    # how it was sent: "at:1.234" or "phase:eval@3"
    rank: int
    kind: str = "termination"      # the notice's kind (rebalance/maintenance: the run must go on)
    phase: str = "none"            # where the training thread was when it fired ("none": it never fired)
    iter: int = -1
    verdict: str = "wrong"
    why: str = ""
    step: Optional[int] = None     # committed step
    trained: int = 0               # iterations completed before the trial ended
    stepped: int = 0               # optimizer steps taken by then (records' ``opt_steps``; else iterations)
    codes: dict[int, Any] = field(default_factory=dict)
    notice_to_commit: Optional[float] = None
    seconds: float = 0.0
    folder: str = ""


def _exit_codes(run: Run, nproc: int) -> dict[int, Any]:
    """Each rank's exit code: the hook's ``exit`` line, else torchrun's failure summary, else the process's."""
    codes: dict[int, Any] = {r: c for r, c in run.codes.items() if c is not None}
    for e in run.events("exit"):
        if "rank" in e and "code" in e:
            codes.setdefault(int(e["rank"]), e["code"])
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", run.log):
        codes.setdefault(int(m.group(1)), int(m.group(2)))
    if nproc == 1 and 0 not in codes:
        codes[0] = run.returncode
    if run.returncode == 0:
        for r in range(nproc):
            codes.setdefault(r, 0)
    return codes


def crashes(run: Run) -> list[str]:
    """What a training process raised: the hook's "training thread raised" line, or a worker's traceback
    (torchrun's own ``ChildFailedError`` report is not one, nor a traceback quoted inside one of the hook's JSON
    lines: ``periodic_failed`` quotes DCP's ``CheckpointException`` of an aborted periodic upload)."""
    out = [f"rank {e.get('rank')}: {e.get('error')}" for e in json_lines(run.log)
           if "raised" in str(e.get("event", "")) and e.get("error")]
    plain = "\n".join(ln for ln in run.log.splitlines() if not ln.lstrip().startswith("{"))
    for block in plain.split("Traceback (most recent call last):")[1:]:
        lines = block.strip().splitlines()
        if "ChildFailedError" in block[:4000] or "torch/distributed/run.py" in block[:4000]:
            continue
        last = next((ln for ln in lines if ln and not ln.startswith((" ", "\t")) and not ln.startswith("{")),
                    lines[-1] if lines else "")
        out.append(last.strip()[:300])
    return out


def _notice_to_commit(trial: Run, fired_t: Optional[float]) -> Optional[float]:
    if fired_t is None:
        return None
    for e in trial.events("checkpoint_committed"):
        ts = e.get("timestamp")
        if isinstance(ts, str):
            from spotguard.timefmt import parse_rfc3339  # noqa: PLC0415

            with contextlib.suppress(Exception):
                return round(parse_rfc3339(ts).timestamp() - fired_t, 3)
    return None


ORDINARY = ("rebalance", "maintenance")  # notices that must not stop the run (SPEC: an ordinary checkpoint)


def run_trial(ref: Reference, notice: str, folder: Path, *, seed: int, kind: str = "termination",
              timeout: float = 120.0) -> Trial:
    """One notice (``kind``: termination, or rebalance/maintenance), its outcome in storage, the resume(s), the
    verdict."""
    p = ref.pattern
    rng = random.Random(seed)
    rank = rng.randrange(p.nproc)
    env = {"EXO_NOTICE": notice, "EXO_NOTICE_RANK": str(rank), "EXO_SEED": str(seed),
           "EXO_NOTICE_SOURCE": rng.choice(("signal", "drill")), "EXO_NOTICE_KIND": kind,
           "EXO_NOTICE_DEADLINE": f"{rng.uniform(20, 30) if kind not in ORDINARY else rng.uniform(60, 120):.1f}"}
    short = dict(p.env).get("EXO_ORDINARY_DEADLINE")  # a pattern's ordinary notices with a nearer deadline
    if kind in ORDINARY and short:
        env["EXO_NOTICE_DEADLINE"] = short
    if kind in ORDINARY:
        env["EXO_NOTICE_SOURCE"] = "drill"  # a signal is always an emergency; ordinary notices come from the daemon
    storage = folder / "ckpt"
    t = Trial(p.name, notice, rank, kind=kind, folder=str(folder))
    t0 = time.monotonic()
    try:
        if kind in ORDINARY:
            _judge_ordinary(ref, t, env, folder, storage, timeout)
        else:
            _judge(ref, t, env, folder, storage, timeout)
    except Exception as exc:  # a bug of the oracle's own must show as such, not as a pass
        t.verdict, t.why = "wrong", f"oracle error: {type(exc).__name__}: {exc}"
    t.seconds = round(time.monotonic() - t0, 2)
    return t


def _reason(c: dict[str, Any]) -> Optional[str]:
    return (c.get("record") or {}).get("reason")


def _only_up_to(storage: Path, step: int, dest: Path) -> Path:
    """A copy of ``storage`` without the checkpoints after ``step`` (and the ``latest`` hint), so that a resume
    loads the checkpoint of ``step``: how an older commit (a periodic one before the notice's) is checked."""
    later = {c["dir"] for c in committed(storage) if int(c["step"]) > step}

    def ignore(d: str, names: list[str]) -> set[str]:
        return {n for n in names if Path(d) == storage and (n in later or n == "latest")}

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(storage, dest, ignore=ignore)
    return dest


def _check_commits(ref: Reference, folder: Path, storage: Path, ck: list[dict[str, Any]],
                   timeout: float, ours: Optional[list[dict[str, Any]]] = None,
                   runs: Optional[dict[int, Run]] = None) -> list[str]:
    """Every committed checkpoint (``Pattern.check_all``; else those in ``ours``, the notice's): a resume from it
    (the newest in place, older ones from a copy that ends at them) must start equal to the reference at its
    step and end equal to the reference's final state. ``runs``: filled with each resume run, by step."""
    ours = ck if ours is None else ours  # (where the notice committed nothing: the newest)
    p = ref.pattern
    problems: list[str] = []
    for k, c in enumerate(ck):
        s = int(c["step"])
        newest = k == len(ck) - 1
        if not (p.check_all or c in ours):
            continue
        where = storage if newest else _only_up_to(storage, s, folder / f"upto-{s}")
        tag = "resume" if newest else f"resume-{s}"
        what = f"{_reason(c) or 'checkpoint'} step {s}" + ("" if newest else " (older commit)")
        resume = launch(p, folder, tag, where, {}, timeout)
        if runs is not None:
            runs[s] = resume
        if resume.timed_out or resume.returncode != 0:
            problems.append(f"resume from {what} failed (rc {resume.returncode}, timed out {resume.timed_out}):\n"
                            f"{resume.tail(12)}")
            continue
        for r in range(p.nproc):
            got = resume.of(r, "resumed")
            if not got or got[0]["completed"] != s:
                problems.append(f"rank {r} resumed at {got[0]['completed'] if got else None}, committed {what}")
                continue
            d = differing(ref.by_rank[r][s], got[0])
            if d:
                problems.append(f"rank {r} at {what} differs: {', '.join(d)}")
            fin = resume.of(r, "final")
            d = differing(ref.final[r], fin[0]) if fin else ["<no final record>"]
            if d:
                problems.append(f"rank {r} final after resuming from {what} differs: {', '.join(d)}")
    return problems


def _trial_run(ref: Reference, t: Trial, env: dict[str, str], folder: Path, storage: Path,
               timeout: float) -> tuple[Run, list[dict[str, Any]]]:
    """Run the trial; fill in where the notice fired, iterations trained and exit codes."""
    p = ref.pattern
    trial = launch(p, folder, "trial", storage, env, timeout)
    fired = [x for recs in trial.records.values() for x in recs if x["kind"] == "notice"]
    if fired:
        t.phase, t.iter = fired[0]["phase"], fired[0]["iter"]
    t.trained = max((x["completed"] for recs in trial.records.values() for x in recs if x["kind"] == "iter"),
                    default=0)
    t.stepped = max((x.get("opt_steps", x["completed"]) for recs in trial.records.values() for x in recs
                     if x["kind"] == "iter"), default=0)
    t.codes = _exit_codes(trial, p.nproc)
    return trial, fired


def _hung_or_crashed(t: Trial, trial: Run, timeout: float, what: str) -> bool:
    """Wrong at once (``t.why`` set): the trial hung, or a training process raised (a notice must never kill the
    training thread, whatever the exit code then says)."""
    if trial.timed_out:
        t.why = f"trial hung: killed after {timeout:.0f} s ({what} in {t.phase}); log tail:\n{trial.tail(12)}"
        return True
    crashed = crashes(trial)
    if crashed:
        t.why = f"training process raised: {crashed[0]}" + (f" (+{len(crashed) - 1} more)" if len(crashed) > 1 else "")
        return True
    return False


def _judge(ref: Reference, t: Trial, env: dict[str, str], folder: Path, storage: Path, timeout: float) -> None:
    p = ref.pattern
    trial, fired = _trial_run(ref, t, env, folder, storage, timeout)
    if _hung_or_crashed(t, trial, timeout, "notice"):
        if not trial.timed_out:
            t.step = (committed(storage) or [{}])[-1].get("step")
        return
    ck = committed(storage)
    finished = all(trial.of(r, "final") for r in range(p.nproc)) and trial.returncode == 0
    exits = trial.events("exit")
    # A periodic (every=) checkpoint may stand from before the notice: it is the notice's only when an exit
    # line says so (the agreed step was already committed by it).
    exit_steps = {e.get("step") for e in exits if e.get("committed")}
    ours = [c for c in ck if _reason(c) != "periodic" or c.get("step") in exit_steps]
    if not ours:
        codes = set(t.codes.values())
        if finished:
            bad = [f"rank {r}: {', '.join(d)}" for r in range(p.nproc)
                   if (d := differing(ref.final[r], trial.of(r, "final")[0]))]
            if fired and not trial.events("notice_after_last_step"):
                bad.append("a notice fired, the run trained to its end and no notice_after_last_step says why")
            t.verdict, t.why = ("honest-no-commit", "finished before the notice acted (notice_after_last_step)") \
                if not bad else ("wrong", f"finished without a commit: {'; '.join(bad)}")
        elif (codes == {NOTHING_LOST} and t.trained > 0 and t.stepped == 0 and exits
              and all(e.get("nothing_to_save") for e in exits)):
            # iterations ran but every optimizer step was skipped (nanskip's NaN guard): weights and optimizer
            # state are the initial ones, so a restart from nothing is the same run — nothing was lost
            t.verdict, t.why = "honest-no-commit", (f"{t.trained} iterations trained without an optimizer step "
                                                    "(all skipped): nothing_to_save")
        elif NOTHING_LOST in codes and t.trained > 0:
            before = f"; periodic commits {[c.get('step') for c in ck]}" if ck else ""
            t.why = (f"exit {NOTHING_LOST} ('nothing lost') with nothing committed for the notice after {t.trained} "
                     f"trained iterations (exit lines: {[(e.get('rank'), e.get('nothing_to_save')) for e in exits]}"
                     f"{before})")
        elif codes == {NOTHING_LOST} and t.trained == 0 and all(e.get("nothing_to_save") for e in exits) and exits:
            t.verdict, t.why = "honest-no-commit", "nothing trained yet: nothing_to_save"
        elif codes and codes <= {75} and (trial.events("checkpoint_failed") or trial.events("peers_lost")):
            t.verdict, t.why = "honest-no-commit", "save failed, said so (75)"
        else:
            t.why = f"no commit, exit codes {t.codes}, rc {trial.returncode}; log tail:\n{trial.tail(12)}"
        if t.verdict != "wrong" and ck:  # what was committed before the notice (periodic) must still be exact
            problems = _check_commits(ref, folder, storage, ck, timeout, ck[-1:])
            if problems:
                t.verdict, t.why = "wrong", "; ".join(problems)
            else:
                t.why += f"; periodic commits {[int(c['step']) for c in ck]} exact"
        return
    s = int(ours[-1]["step"])
    t.step = s
    t.notice_to_commit = _notice_to_commit(trial, fired[0]["t"] if fired else None)
    problems: list[str] = []
    if finished:
        problems.append("trial committed a checkpoint yet trained to the end (exit 0)")
    elif set(t.codes.values()) != {NOTHING_LOST} or len(t.codes) < p.nproc:
        problems.append(f"exit codes {t.codes} after a commit (want {NOTHING_LOST} on every rank)")
    if s > t.trained:
        problems.append(f"committed step {s} > iterations completed {t.trained}")
    if int(ck[-1]["step"]) != s:
        problems.append(f"the newest commit is step {ck[-1]['step']} ({_reason(ck[-1])}), not the notice's {s}")
    named = sorted(x for x in exit_steps if x is not None)
    if named and named != [s]:
        problems.append(f"the exit lines name committed step(s) {named}, storage's notice checkpoint is {s}")
    problems += _doomed_plan(p, t, ours[-1])
    resumes: dict[int, Run] = {}
    inexact = _check_commits(ref, folder, storage, ck, timeout, ours, resumes)
    if problems or not inexact:
        t.why = "; ".join(problems + inexact)
        t.verdict = "wrong" if t.why else "exact"
    elif p.limitation and len(ck) == 1 and s in resumes:  # the trial as exact asks; only its resume is not
        _limitation(ref, t, trial, resumes[s], s, inexact)
    else:
        t.why = "; ".join(inexact)


def _limitation(ref: Reference, t: Trial, trial: Run, resume: Run, s: int, inexact: list[str]) -> None:
    """``limitation-warned`` or ``wrong`` for a trial whose checkpoint of step ``s`` resumed inexactly (``inexact``
    says how): the hook must have logged ``Pattern.warned`` before its commit, and the state the resume loaded
    must equal the reference at the end of one iteration (the same on every rank, one the trial completed) whose
    record's ``opt_steps`` is ``s`` (the checkpoint itself is exact; the loop's clock is what the resume gets
    wrong), and the resume must have run to its end (exit 0)."""
    from spotguard.timefmt import parse_rfc3339  # noqa: PLC0415

    def when(e: dict[str, Any]) -> float:
        return parse_rfc3339(e["timestamp"]).timestamp() if isinstance(e.get("timestamp"), str) else float("inf")

    p = ref.pattern
    if resume.timed_out or resume.returncode != 0:  # the limitation is a clock, never a failing resume
        t.why = "; ".join(inexact)
        return
    warned = min((when(e) for e in trial.events(p.warned)), default=float("inf"))
    commit = min((when(e) for e in trial.events("checkpoint_committed") if e.get("step") in (s, None)),
                 default=float("-inf"))
    if not warned < commit:
        t.why = (f"no {p.warned} logged before the commit of step {s} (limitation: {p.limitation}); "
                 + "; ".join(inexact))
        return
    found: set[int] = set()
    for r in range(p.nproc):
        got = resume.of(r, "resumed")
        at = [j for j, rec in ref.by_rank[r].items() if rec.get("opt_steps", 0) == s and j <= t.trained
              and got and not differing(rec, got[0])]
        found.update(at or [-1])
    if len(found) != 1 or -1 in found:
        t.why = (f"the checkpoint of optimizer step {s} equals no reference iteration with {s} optimizer steps on "
                 f"every rank (matches: {sorted(found)}); " + "; ".join(inexact))
        return
    j = found.pop()
    t.verdict = "limitation-warned"
    t.why = (f"checkpoint of optimizer step {s} = the reference after {j} iterations; the resume re-runs {j - s} "
             f"iteration(s) ({p.warned} logged before the commit)")


def _doomed_plan(p: Pattern, t: Trial, c: dict[str, Any]) -> list[str]:
    """Under DDP/FSDP2 the notice reaches one rank only: its emergency checkpoint must have been planned around
    that rank (issue 26: the record's ``writers`` names it doomed; the others wrote the replicated state; under
    ``SPOTGUARD_EVACUATE=always`` its ``evacuated`` names the survivor that wrote the doomed rank's shards)."""
    if p.nproc < 2 or not p.name.startswith(("ddp", "fsdp2")) or _reason(c) != "emergency":
        return []
    writers = ((c.get("record") or {}).get("extra") or {}).get("writers") or {}
    if writers.get("doomed") != [t.rank]:
        return [f"the notice reached rank {t.rank} only, yet the commit record's writers say {writers}"]
    if ("SPOTGUARD_EVACUATE", "always") in p.env:  # its unique bytes went through the survivor (evacuate.py)
        ev = (writers.get("evacuated") or {}).get(str(t.rank)) or {}
        if ev.get("to") not in set(range(p.nproc)) - {t.rank} or not ev.get("bytes"):
            return [f"SPOTGUARD_EVACUATE=always, yet the record's writers show no evacuation of rank {t.rank} "
                    f"to a survivor: {writers} (a fallback logs checkpoint_evacuation_declined / 'cannot serialise')"]
    return []


def _judge_ordinary(ref: Reference, t: Trial, env: dict[str, str], folder: Path, storage: Path,
                    timeout: float) -> None:
    """A rebalance/maintenance notice (SPEC: "the hook takes an ordinary checkpoint, keeps training"): the run
    must train to its end, exit 0 and end bitwise where the reference ends (the save may not disturb it); the
    notice's checkpoint, if committed, must be exact (a resume from it ends equal too). Nothing committed for it
    is honest only when the hook said why (``notice_after_last_step``, ``checkpoint_failed``) or the notice came
    after the run ended."""
    p = ref.pattern
    trial, fired = _trial_run(ref, t, env, folder, storage, timeout)
    if _hung_or_crashed(t, trial, timeout, "ordinary notice"):
        return
    finished = all(trial.of(r, "final") for r in range(p.nproc)) and trial.returncode == 0
    if not finished:
        t.why = (f"an ordinary ({t.kind}) notice stopped the run: exit codes {t.codes}, rc {trial.returncode}; "
                 f"log tail:\n{trial.tail(12)}")
        return
    problems = [f"rank {r} final differs from the uninterrupted run's: {', '.join(d)}" for r in range(p.nproc)
                if (d := differing(ref.final[r], trial.of(r, "final")[0]))]
    ck = committed(storage)
    said = {e.get("step") for e in trial.events("checkpoint_committed")
            if fired and e.get("notice_id") == fired[0].get("id")}
    ours = [c for c in ck if _reason(c) != "periodic" or c.get("step") in said]
    if len(ours) > 1:
        problems.append(f"one ordinary notice, {len(ours)} checkpoints for it (steps {[c['step'] for c in ours]})")
    if not ours:
        why = next((name for name in ("notice_after_last_step", "checkpoint_failed", "checkpoint_skipped")
                    if trial.events(name)), None)
        if fired and not why:
            problems.append(f"an ordinary notice fired in {t.phase}@{t.iter}, nothing was committed and no "
                            "notice_after_last_step / checkpoint_failed / checkpoint_skipped says why")
        if not problems and ck:
            problems += _check_commits(ref, folder, storage, ck, timeout, ck[-1:])
        if problems:
            t.why = "; ".join(problems)
        else:
            t.verdict = "honest-no-commit"
            t.why = "the run went on; nothing committed: " + (why or "the notice came after the last step")
        return
    s = int(ours[-1]["step"])
    t.step = s
    t.notice_to_commit = _notice_to_commit(trial, fired[0]["t"] if fired else None)
    if s > t.trained:
        problems.append(f"committed step {s} > iterations completed {t.trained}")
    problems += _check_commits(ref, folder, storage, ck, timeout, ours)
    if problems:
        t.why = "; ".join(problems)
    else:
        t.verdict, t.why = "exact", ""


# ---------------------------------------------------------------- the matrix

def summarize(trials: list[Trial]) -> dict[str, Any]:
    """pattern -> phase -> {trials, exact, honest-no-commit, wrong, first_wrong}."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for t in trials:
        ph = t.phase if t.kind == "termination" else f"{t.kind[:5]}:{t.phase}"  # ordinary notices apart
        cell = table.setdefault(t.pattern, {}).setdefault(ph, {"trials": 0, **{v: 0 for v in VERDICTS}})
        cell["trials"] += 1
        cell[t.verdict] += 1
        if t.verdict == "wrong" and "first_wrong" not in cell:
            cell["first_wrong"] = {"notice": t.notice, "why": t.why[:600], "folder": t.folder}
    return table


def render(table: dict[str, Any]) -> str:
    lines = [f"{'pattern':<13} {'phase':<14} {'trials':>6} {'exact':>6} {'honest':>6} {'limit':>6} {'wrong':>6}"
             "  first wrong"]
    for pat, phases in table.items():
        for ph, c in sorted(phases.items()):
            why = c.get("first_wrong", {}).get("why", "").splitlines()
            lines.append(f"{pat:<13} {ph:<14} {c['trials']:>6} {c['exact']:>6} {c['honest-no-commit']:>6} "
                         f"{c['limitation-warned']:>6} {c['wrong']:>6}  {why[0][:160] if why else ''}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patterns", default=",".join(n for n, p in PATTERNS.items() if not p.open_bug),
                    help="comma-separated (default: all but those with a known open bug: " +
                    ", ".join(n for n, p in PATTERNS.items() if p.open_bug) + ")")
    ap.add_argument("--notices", type=int, default=216, help="random-moment trials across the matrix")
    ap.add_argument("--jobs", type=int, default=2, help="trials run at the same time")
    ap.add_argument("--ordinary-every", type=int, default=6,
                    help="every Nth notice is an ordinary one (rebalance, then maintenance); 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="keep every run's logs and records here")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exactness.json"))
    args = ap.parse_args(argv)
    names = [n for n in args.patterns.split(",") if n]
    unknown = [n for n in names if n not in PATTERNS]
    if unknown:
        ap.error(f"unknown patterns {unknown}; known: {', '.join(PATTERNS)}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="sg-exact-"))
    t0 = time.monotonic()
    rng = random.Random(args.seed)
    with ThreadPoolExecutor(args.jobs) as pool:
        refs = dict(zip(names, pool.map(lambda n: reference(PATTERNS[n], work / n / "ref"), names)))
        plan = []
        ordinary = 0
        for k in range(args.notices):
            n = names[k % len(names)]
            kind = "termination"
            if args.ordinary_every > 0 and k % args.ordinary_every == args.ordinary_every - 1:
                kind = ORDINARY[ordinary % len(ORDINARY)]
                ordinary += 1
            plan.append((n, f"at:{rng.uniform(0, refs[n].loop_seconds):.3f}", rng.randrange(1 << 30), k, kind))
        done: list[Trial] = []
        lock = threading.Lock()

        def one(item: tuple[str, str, int, int, str]) -> Trial:
            n, notice, seed, k, kind = item
            tr = run_trial(refs[n], notice, work / n / f"trial-{k:04d}", seed=seed, kind=kind)
            with lock:
                done.append(tr)
                print(f"[{len(done)}/{len(plan)}] {tr.pattern:<13} {tr.kind[:5]:<5} {tr.phase:<12} {tr.verdict:<16} "
                      f"{tr.why.splitlines()[0][:140] if tr.why else ''}", flush=True)
            return tr

        trials = list(pool.map(one, plan))
    table = summarize(trials)
    print(render(table))
    wrong = sum(t.verdict == "wrong" for t in trials)
    n2c = sorted(t.notice_to_commit for t in trials if t.notice_to_commit is not None)
    doc = {"seconds": round(time.monotonic() - t0, 1), "notices": len(trials), "wrong": wrong,
           "limitation_warned": sum(t.verdict == "limitation-warned" for t in trials),
           "limitations": {n: PATTERNS[n].limitation for n in names if PATTERNS[n].limitation},
           "patterns": {n: PATTERNS[n].what for n in names},
           "notice_to_commit_s": {"n": len(n2c), "p50": n2c[len(n2c) // 2] if n2c else None,
                                  "max": n2c[-1] if n2c else None},
           "table": table, "trials": [t.__dict__ for t in trials], "workdir": str(work)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{len(trials)} notices, {wrong} wrong, {doc['seconds']} s; {args.out}; runs kept in {work}")
    if not args.workdir and wrong == 0:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
