"""``ElasticDistributedSampler``: a ``DistributedSampler`` whose position is global, so it resumes on any world size.

``torch.utils.data.DistributedSampler`` gives rank ``r`` of ``W`` the positions
``r, r+W, r+2W, ...`` of the epoch's permutation. With a global batch of ``B``
samples split over the ranks (``B/W`` each), global batch ``k`` is therefore the
contiguous slice ``[k*B, (k+1)*B)`` of the permutation, whatever ``W`` is. So the
position that survives a world-size change is one number: how many samples of
the epoch's permutation the job as a whole has consumed. That number, with the
epoch and the seed, is this sampler's ``state_dict()``; ``load_state_dict()``
accepts it on any world size and the next ``__iter__`` deals the *rest* of the
same permutation over the current ranks (the same interleaving, padding and
``drop_last`` rules as ``DistributedSampler``, applied to the rest). A fresh
epoch yields exactly what ``DistributedSampler`` yields with the same arguments.

What "consumed" means (the prefetch trap): a ``DataLoader`` with workers pulls
indices ahead of the training loop (``prefetch_factor * num_workers`` batches),
so counting the indices this sampler handed out over-counts. Two sources, the
first that applies wins:

1. the ``DataLoader`` built on this sampler is known (``attach(loader)``, which
   the spotguard hook calls itself when it is given the loader): consumed =
   batches the loader's iterator has *returned to the training loop* x the
   loader's batch size x world size. Exact with any
   number of workers, prefetching and gradient accumulation.
2. otherwise: the indices this rank's iterator has handed out x world size,
   exact only when nothing prefetches (``num_workers=0``). Pass the loader
   (or call ``attach``) when it has workers.

The spotguard hook recognises this sampler by type (and by its
``spotguard_scope = "global"`` class attribute): its state is saved like any
loader's (from the snapshot taken right after each optimizer step) and restored
on *every* rank from the checkpoint, whatever the old and new world sizes. A
plain ``DataLoader`` built on it may be passed instead; the hook then uses the
sampler and attaches the loader. Create the loader's iterator after
``hook.resume()`` (a prefetching iterator made before it would start from 0).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Iterator, Optional, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["ElasticDistributedSampler"]

_STATE_VERSION = 1


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _deal(rest: list[int], world: int, drop_last: bool) -> list[int]:
    """``DistributedSampler``'s even split of what is left of the epoch: pad or cut to a multiple of ``world``."""
    n = len(rest)
    if drop_last:
        return rest[: (n // world) * world]
    total = math.ceil(n / world) * world
    pad = total - n
    if pad == 0 or n == 0:
        return rest
    return rest + (rest * math.ceil(pad / n))[:pad]


class ElasticDistributedSampler(Sampler[int]):
    """Drop-in for ``torch.utils.data.DistributedSampler`` whose ``state_dict`` is the global position.

    Same constructor as ``DistributedSampler``; without an initialised process
    group ``num_replicas``/``rank`` default to 1/0 (a one-rank resume needs no
    ``init_process_group``). ``state_dict()`` -> ``{"epoch", "seed", "consumed",
    "dataset_len", "shuffle", "drop_last", "world_size", "version"}``, plain ints
    and bools; ``load_state_dict`` works on any world size.
    """

    spotguard_scope = "global"  # the hook restores it on every rank, whatever the world size

    def __init__(self, dataset: Sized, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        world, me = _world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = me if rank is None else rank
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._resume_at = 0  # global position the next __iter__ starts from (set by load_state_dict)
        self._resume_rng: Optional[torch.Tensor] = None  # the global RNG right after a resume (note_resume_rng)
        self._base = 0  # global position the current iterator started from
        self._handed = 0  # indices the current iterator has handed out (this rank)
        self._loader: Optional[weakref.ref[Any]] = None
        self._taken = 0  # batches the attached loader's iterator returned to the training loop

    # ---------------------------------------------------------------- sampler

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _rest_for_rank(self, start: int) -> list[int]:
        dealt = _deal(self._order()[start:], self.num_replicas, self.drop_last)
        return dealt[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start, self._resume_at = self._resume_at, 0
        self._base, self._handed, self._taken = start, 0, 0
        mine = self._rest_for_rank(start)
        # A DataLoader iterator built for the rest of an epoch after a resume: the uninterrupted run built
        # its iterator at the epoch's start, so the seed DataLoader draws from the global torch RNG for it
        # (``_base_seed``, when the loader has no generator=) is a draw that run never made at this point.
        # Undone at the first index (see note_resume_rng), or every later random number shifts.
        rng, self._resume_rng = (self._resume_rng if start > 0 else None), None
        return self._hand_out(mine, rng)

    def note_resume_rng(self, state: torch.Tensor) -> None:
        """The global torch RNG as the resume left it (the spotguard hook calls this after restoring it)."""
        self._resume_rng = state.clone()

    def _hand_out(self, mine: list[int], rng: Optional[torch.Tensor] = None) -> Iterator[int]:
        if rng is not None:  # the first next(): right after DataLoader's draw (also when nothing is left,
            _undo_base_seed_draw(rng)  # a resume at the very end of an epoch: an empty iterator, then the next)
        for i in mine:
            self._handed += 1
            yield i

    def __len__(self) -> int:
        """Samples this rank yields in the next ``__iter__`` (the rest of the epoch after a resume)."""
        rest = max(0, len(self.dataset) - self._resume_at)
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``; a new epoch drops a resumed mid-epoch position."""
        if int(epoch) != self.epoch:
            self._resume_at = self._base = self._handed = self._taken = 0
        self.epoch = int(epoch)

    # ------------------------------------------------------------ position

    def attach(self, loader: Any) -> None:
        """Count consumption by the batches ``loader`` (a ``DataLoader`` on this sampler) returns to the training loop.

        Wraps the loader's iterator factory so each iterator it makes counts
        the batches it hands over (``_Counted``); nothing else changes.
        """
        self._loader = weakref.ref(loader)
        orig = loader._get_iterator
        if getattr(orig, "_spotguard_counted", False):
            return
        me = weakref.ref(self)

        def _get_iterator() -> Any:
            return _Counted(orig(), me)

        _get_iterator._spotguard_counted = True  # type: ignore[attr-defined]
        loader._get_iterator = _get_iterator

    def _loader_batch(self) -> Optional[int]:
        loader = self._loader() if self._loader is not None else None
        if loader is None:
            return None
        bs = getattr(loader, "batch_size", None)
        if bs is None:
            bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        return bs if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 else None

    def consumed(self) -> int:
        """Samples of this epoch's permutation the whole job has consumed (see the module docstring)."""
        n = len(self.dataset)
        if self._base == 0 and self._handed == 0 and self._resume_at:
            return min(self._resume_at, n)  # loaded, not iterated yet
        bs = self._loader_batch()
        local = self._handed if bs is None else min(self._taken * bs, self._handed)
        return min(n, self._base + local * self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self.consumed(),
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the global position from ``state`` (from any world size); the next ``__iter__`` continues there."""
        if not isinstance(state, dict):
            raise ValueError(f"ElasticDistributedSampler state must be a dict, got {type(state).__name__}")
        try:
            epoch, seed, consumed, n = (int(state[k]) for k in ("epoch", "seed", "consumed", "dataset_len"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an ElasticDistributedSampler state ({exc!r}): {sorted(state)}") from None
        if n != len(self.dataset):
            raise ValueError(f"sampler state is for a dataset of {n} samples, this one has {len(self.dataset)}: "
                             "resume with the same dataset (or drop the sampler from the state dict)")
        if not 0 <= consumed <= n or epoch < 0:
            raise ValueError(f"sampler state out of range: epoch={epoch} consumed={consumed} of {n}")
        if bool(state.get("shuffle", self.shuffle)) != self.shuffle:
            raise ValueError("sampler state was saved with shuffle="
                             f"{bool(state.get('shuffle'))}, this sampler has shuffle={self.shuffle}")
        self.epoch, self.seed, self._resume_at = epoch, seed, consumed
        self._base = self._handed = self._taken = 0


def _undo_base_seed_draw(before: torch.Tensor) -> None:
    """Set the global torch RNG back to ``before`` if exactly DataLoader's one base-seed draw happened since
    (anything else drew too, or nothing: leave it, those draws are the loop's own)."""
    now = torch.get_rng_state()
    torch.set_rng_state(before)
    torch.empty((), dtype=torch.int64).random_()  # the draw _BaseDataLoaderIter makes without a generator
    if torch.equal(torch.get_rng_state(), now):
        torch.set_rng_state(before)
    else:
        torch.set_rng_state(now)


class _Counted:
    """A ``DataLoader`` iterator that tells its sampler each batch it returns (everything else is delegated)."""

    def __init__(self, it: Any, sampler: "weakref.ref[ElasticDistributedSampler]") -> None:
        self._it = it
        self._sampler = sampler

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        s = self._sampler()
        if s is not None:
            s._taken += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:  # _reset (persistent workers), _num_yielded, ...
        return getattr(self._it, name)
