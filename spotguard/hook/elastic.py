"""Resume on another world size: which rank's saved state each object of a rank takes.

Every rank writes one per-rank blob (``__spotguard__rank<r>``: RNG, loaders,
running-stat buffers, schedulers, scalers, stateful objects, step). On resume,
with ``saved`` the ranks that wrote one and ``rank`` this process:

- **own**: ``rank`` is in ``saved``: the rank reads its own blob and restores
  everything from it, exactly as on a same-size resume (bitwise).
- **new**: ``rank`` is not in ``saved`` (the job grew): the rank reads rank 0's
  blob and restores only **global** objects from it (schedulers, scaler,
  stateful objects, the elastic sampler, running-stat buffers: under DDP they
  are broadcast from rank 0); **per_rank** objects (loaders by default) are left
  as constructed, and its RNG streams are **derived** (``derive_rng``): never a
  copy of another rank's stream.
- Ranks in ``saved`` at or above the new world size are **dropped** (the job shrank).

Scope rule: ``state.py`` (defaults, ``spotguard_scope`` class attribute, the
hook's ``scope=`` keyword). Models and optimizers are resharded by
``torch.distributed.checkpoint`` (DDP's replicated tensors and FSDP2's shards
alike). One ``elastic_resume`` log line per rank says what happened.
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from .state import GLOBAL, RESERVED_PREFIX, restore_rng

__all__ = ["saved_ranks", "source_rank", "Restored", "derive_rng", "rank_key"]

_RANK_KEY = re.compile(re.escape(RESERVED_PREFIX) + r"rank(\d+)")


def rank_key(rank: int) -> str:
    return f"{RESERVED_PREFIX}rank{rank}"


def saved_ranks(keys: Iterable[str]) -> list[int]:
    """Ranks that wrote a per-rank blob, from the checkpoint's DCP metadata keys."""
    return sorted(int(m.group(1)) for k in keys if (m := _RANK_KEY.fullmatch(k)))


def source_rank(saved: list[int], rank: int) -> int | None:
    """Whose blob ``rank`` reads: its own, else rank 0's (the lowest saved), None if the checkpoint has none."""
    if rank in saved:
        return rank
    return saved[0] if saved else None


def derive_rng(src: Mapping[str, Any], step: int, rank: int) -> int:
    """Seed python, numpy and torch (CPU and CUDA) of a new rank; returns the seed.

    seed = first 8 bytes of SHA-256("spotguard-elastic-rng", step, rank, rank 0's
    saved torch CPU generator state): deterministic for a given checkpoint and
    rank, different for every rank and every checkpoint.
    """
    h = hashlib.sha256(f"spotguard-elastic-rng|{int(step)}|{int(rank)}|".encode())
    t = src.get("torch")
    if isinstance(t, torch.Tensor):
        h.update(t.contiguous().numpy().tobytes())
    seed = int.from_bytes(h.digest()[:8], "little")
    random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
    return seed


@dataclass
class Restored:
    """What one rank restored, for the ``elastic_resume`` log line."""

    own: bool
    source: int
    globals: list[str] = field(default_factory=list)  # global objects restored (own or rank 0's copy)
    mapped: list[str] = field(default_factory=list)  # per-rank objects restored from this rank's own copy
    fresh: list[str] = field(default_factory=list)  # per-rank objects left as constructed (new rank)
    missing: list[str] = field(default_factory=list)  # objects the checkpoint has no state for
    rng: str = "own"  # "own" | "derived"

    def fields(self) -> dict[str, Any]:
        return {"state_from_rank": self.source, "global": self.globals, "per_rank_own": self.mapped,
                "per_rank_fresh": self.fresh, "missing": self.missing, "rng": self.rng}


def restore(per: Mapping[str, Any], *, own: bool, source: int, roles: Mapping[str, Mapping[str, Any]],
            scope: Mapping[str, str]) -> Restored:
    """Load the scoped objects of ``roles`` (role -> key -> object) from blob ``per`` by the rule above."""
    out = Restored(own=own, source=source)
    for role, objs in roles.items():
        saved = per.get(role, {})
        for key, obj in objs.items():
            is_global = scope.get(key, GLOBAL) == GLOBAL
            if not own and not is_global:
                out.fresh.append(key)
            elif key not in saved:
                out.missing.append(key)
            else:
                obj.load_state_dict(saved[key])
                (out.globals if is_global else out.mapped).append(key)
    return out


def restore_rng_for(per: Mapping[str, Any], out: Restored, *, step: int, rank: int) -> None:
    """Last step of a load (nothing after it may draw random numbers): own streams, or derived ones."""
    if out.own:
        restore_rng(per.get("rng", {}))
    else:
        derive_rng(per.get("rng", {}), step, rank)
        out.rng = "derived"
