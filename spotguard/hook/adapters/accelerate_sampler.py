"""Accelerate's default shuffle (``use_seedable_sampler=False``): the sampler's generator, saved and restored.

Why: ``prepare()`` gives a shuffled loader's ``RandomSampler`` a ``torch.Generator`` (seeded from the global RNG)
and each epoch's permutation is drawn from it when that epoch's iterator starts (rank 0's state broadcast
first); ``save_state`` does not save it. A run resumed past the first epoch drew its permutation from the freshly
seeded generator: another data order, every step after the resume different.

The generator moves only at those draws, so the state before the current epoch's draw is the last state seen
before it changed (read at each optimizer step's post-hook: one ``get_state`` a step). A checkpoint of S holds, in
``spotguard_sampler_generators_<rank>.pt`` (every rank: the state is the same on all), the state the resumed
loop's iterator must draw from: for the loader being iterated, the state before its current epoch's draw when S
is inside the epoch (the resume skips into it with ``skip_first_batches``, which redraws that permutation), the
live one when S ended the epoch (``end_of_dataloader`` at S: the resume starts the next epoch); any other
loader's as it is. ``_realign_at_load`` sets them after ``load_state``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["SAMPLER_GENERATORS", "SamplerGenerators"]

#: ``<this>_<rank>.pt``: {index in ``accelerator._dataloaders``: the generator state a resume sets}
SAMPLER_GENERATORS = "spotguard_sampler_generators"


def _generators(accelerator: Any) -> dict[int, torch.Generator]:
    out = {}
    for i, dl in enumerate(getattr(accelerator, "_dataloaders", [])):
        g = getattr(dl, "synchronized_generator", None)
        if isinstance(g, torch.Generator):
            out[i] = g
    return out


class SamplerGenerators:
    """The prepared loaders' shuffle generators as at each optimizer step (module docstring)."""

    def __init__(self, accelerator: Any) -> None:
        self.acc = accelerator
        self._seen = {i: g.get_state() for i, g in _generators(accelerator).items()}  # not drawn yet: prepare()
        self._before: dict[int, torch.Tensor] = {}  # the state before the latest draw
        self._at: Optional[tuple[int, dict[int, torch.Tensor]]] = None

    def step(self, count: int) -> None:
        """The optimizer post-hook of step ``count``: what a checkpoint of it sets back."""
        gens = _generators(self.acc)
        if not gens:
            return
        gs = getattr(self.acc, "gradient_state", None)
        active = getattr(getattr(gs, "active_dataloader", None), "synchronized_generator", None)
        out: dict[int, torch.Tensor] = {}
        for i, g in gens.items():
            now, seen = g.get_state(), self._seen.get(i)
            if seen is not None and not torch.equal(seen, now):
                self._before[i] = seen
            self._seen[i] = now
            if g is not active or bool(getattr(gs, "end_of_dataloader", False)):
                out[i] = now
            elif i in self._before:
                out[i] = self._before[i]
        self._at = (count, out)

    def of(self, step: int) -> dict[int, torch.Tensor]:
        """What a checkpoint of ``step`` holds ({} when not recorded at its post-hook)."""
        return self._at[1] if self._at is not None and self._at[0] == step else {}

    def write(self, folder: Path, rank: int, states: dict[int, torch.Tensor]) -> None:
        if states:
            torch.save(states, folder / f"{SAMPLER_GENERATORS}_{rank}.pt")

    def load(self, folder: Path, rank: int) -> None:
        """After ``load_state``: each generator set to the saved state (and taken as seen, not drawn yet)."""
        f = folder / f"{SAMPLER_GENERATORS}_{rank}.pt"
        if not f.is_file():
            return
        gens = _generators(self.acc)
        for i, state in torch.load(f, weights_only=True).items():
            if i in gens and isinstance(state, torch.Tensor):
                gens[i].set_state(state)
                self._seen[i] = state.clone()
