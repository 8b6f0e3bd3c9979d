"""What the pattern scripts share: process-group set-up, a small model with dropout, a dataset.

Kept deliberately plain (what a user's script has at its top); the oracle's own calls are ``rt.*``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for ``import _rt`` from a pattern script
import _rt  # noqa: E402

__all__ = ["setup", "Net", "dataset", "batches", "_rt", "is_rank0"]


def setup(distributed: bool = True) -> int:
    """init_process_group (gloo) under torchrun, every RNG seeded per rank (a ``seed_everything``); the rank."""
    torch.set_num_threads(1)  # deterministic CPU kernels (no intra-op chunking), and 2 cores are shared
    rank = 0
    if distributed and "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    return rank


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Net(torch.nn.Module):
    """A tiny MLP with dropout (its masks draw from the global torch RNG)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 1, p: float = 0.2) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.drop = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(hidden, d_out)
        if os.environ.get("EXO_SPECNORM") == "1":  # power-iteration buffers _u/_v move at every training forward
            torch.nn.utils.parametrizations.spectral_norm(self.fc1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def dataset(n: int = 96, d_in: int = 16) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1 + torch.randn(n, 1, generator=g) * 0.1)


def batches(loader: Any, sampler: Any) -> Any:
    """Endless epochs continuing where the sampler resumed (the README's generator)."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)
