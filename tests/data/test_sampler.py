"""``ElasticDistributedSampler``: a DistributedSampler drop-in whose position survives a world-size change."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from spotguard.data import ElasticDistributedSampler


class Ids(torch.utils.data.Dataset):
    """Sample i is the integer i: batches are lists of sample ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def samplers(n: int, world: int, **kw: Any) -> list[ElasticDistributedSampler]:
    return [ElasticDistributedSampler(Ids(n), num_replicas=world, rank=r, **kw) for r in range(world)]


def global_batches(ss: list[ElasticDistributedSampler], steps: int, gbatch: int) -> list[list[int]]:
    """``steps`` global batches: every rank takes ``gbatch / world`` ids from its own iterator."""
    world = len(ss)
    its = [iter(s) for s in ss]
    out = []
    for _ in range(steps):
        batch: list[int] = []
        for it in its:
            batch += [next(it) for _ in range(gbatch // world)]
        out.append(batch)
    return out


@pytest.mark.parametrize("n,world,shuffle,drop_last", [
    (96, 2, True, False), (97, 4, True, False), (97, 4, True, True), (10, 3, False, False), (5, 4, True, False),
])
def test_fresh_epoch_equals_distributed_sampler(n: int, world: int, shuffle: bool, drop_last: bool) -> None:
    for rank in range(world):
        ref = DistributedSampler(Ids(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        mine = ElasticDistributedSampler(Ids(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7,
                                         drop_last=drop_last)
        for epoch in (0, 3):
            ref.set_epoch(epoch)
            mine.set_epoch(epoch)
            assert list(mine) == list(ref)
            assert len(mine) == len(ref)


@pytest.mark.parametrize("worlds", [(2, 1, 4), (4, 2, 1), (1, 3), (2, 2)])
def test_each_sample_once_per_epoch_across_world_size_changes(worlds: tuple[int, ...]) -> None:
    """Fixed global batch of 24: the global batches after each resume are the uninterrupted run's, as sets."""
    n, gb, per_epoch = 96, 24, 4
    ref = samplers(n, 1, seed=5)
    ref[0].set_epoch(1)
    expected = global_batches(ref, per_epoch, gb)

    seen: list[list[int]] = []
    state: Any = None
    cut = [1, 2, 3]  # resume after 1, then 2, then 3 global batches of epoch 1
    for i, world in enumerate(worlds):
        ss = samplers(n, world, seed=5)
        for s in ss:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(1)
        take = (cut[i] if i < len(worlds) - 1 else per_epoch) - len(seen)
        seen += global_batches(ss, take, gb)
        states = [s.state_dict() for s in ss]
        assert all(st["consumed"] == len(seen) * gb for st in states), states
        assert all({k: v for k, v in st.items() if k not in ("world_size",)}
                   == {k: v for k, v in states[0].items() if k not in ("world_size",)} for st in states)
        state = states[0]
    assert [sorted(b) for b in seen] == [sorted(b) for b in expected]
    assert Counter(i for b in seen for i in b) == Counter(range(n))


def test_new_epoch_drops_a_resumed_position() -> None:
    s = ElasticDistributedSampler(Ids(20), num_replicas=2, rank=0, seed=1)
    s.set_epoch(3)
    s.load_state_dict({"epoch": 3, "seed": 1, "consumed": 8, "dataset_len": 20, "shuffle": True})
    assert s.state_dict()["consumed"] == 8 and len(s) == 6
    s.set_epoch(4)
    assert len(s) == 10 and s.state_dict() == {**s.state_dict(), "epoch": 4, "consumed": 0}


def test_saved_seed_wins_and_bad_state_is_refused() -> None:
    s = ElasticDistributedSampler(Ids(20), num_replicas=1, rank=0, seed=1)
    s.load_state_dict({"epoch": 0, "seed": 9, "consumed": 0, "dataset_len": 20, "shuffle": True})
    ref = ElasticDistributedSampler(Ids(20), num_replicas=1, rank=0, seed=9)
    assert list(s) == list(ref)
    with pytest.raises(ValueError, match="dataset of 30 samples"):
        s.load_state_dict({"epoch": 0, "seed": 1, "consumed": 0, "dataset_len": 30})
    with pytest.raises(ValueError, match="out of range"):
        s.load_state_dict({"epoch": 0, "seed": 1, "consumed": 21, "dataset_len": 20})
    with pytest.raises(ValueError, match="not an ElasticDistributedSampler state"):
        s.load_state_dict({"epoch": "x"})
    with pytest.raises(ValueError, match="rank"):
        ElasticDistributedSampler(Ids(4), num_replicas=2, rank=2)


def test_state_counts_what_training_took_not_what_workers_prefetched() -> None:
    """num_workers=2 prefetches 4 batches ahead: the attached loader's count is the truth, the iterator's is not."""
    n, bs, world = 64, 4, 2
    s = ElasticDistributedSampler(Ids(n), num_replicas=world, rank=0, seed=3)
    loader = DataLoader(Ids(n), batch_size=bs, sampler=s, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    assert s._handed > 3 * bs  # the workers' prefetch ran the sampler ahead
    unattached = s.state_dict()["consumed"]
    assert unattached > 3 * bs * world
    s.attach(loader)
    it = iter(loader)  # a fresh iterator, now tracked
    got = [next(it) for _ in range(3)]
    assert s.state_dict()["consumed"] == 3 * bs * world
    del it
    # resume on one rank from that state: the rest of the epoch, no repeat of what rank 0 already took
    r = ElasticDistributedSampler(Ids(n), num_replicas=1, rank=0, seed=3)
    r.load_state_dict(s.state_dict())
    rest = list(r)
    assert len(rest) == n - 3 * bs * world
    assert not set(rest) & {int(i) for b in got for i in b}


def test_attached_persistent_workers_count_per_epoch() -> None:
    n, bs = 40, 4
    s = ElasticDistributedSampler(Ids(n), num_replicas=2, rank=1, seed=0)
    loader = DataLoader(Ids(n), batch_size=bs, sampler=s, num_workers=1, persistent_workers=True)
    s.attach(loader)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        it = iter(loader)
        for _ in range(2 + epoch):
            next(it)
        assert s.state_dict()["epoch"] == epoch
        assert s.state_dict()["consumed"] == (2 + epoch) * bs * 2
    for _ in it:
        pass
    assert s.state_dict()["consumed"] == n


def test_mid_epoch_iterator_after_a_resume_leaves_the_global_rng_alone() -> None:
    """DataLoader draws its base seed from the global RNG when it has no generator=; the uninterrupted run
    drew it at the epoch's start, so the iterator a resumed run builds mid-epoch must not draw again (the
    README's script with dropout diverged after every resume). A fresh epoch still draws, as DataLoader does,
    and a draw of the loop's own between iter() and next() is kept."""
    import torch
    from torch.utils.data import DataLoader

    from spotguard.data import ElasticDistributedSampler

    data = list(range(32))
    src = ElasticDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    it = iter(DataLoader(data, batch_size=4, sampler=src))
    next(it)
    state = src.state_dict()

    resumed = ElasticDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    resumed.note_resume_rng(before)  # what the hook does after restoring the RNG
    next(iter(DataLoader(data, batch_size=4, sampler=resumed)))
    assert torch.equal(torch.get_rng_state(), before)

    torch.manual_seed(7)  # a fresh epoch: the draw is DataLoader's own, as in an uninterrupted run
    next(iter(DataLoader(data, batch_size=4, sampler=ElasticDistributedSampler(data, num_replicas=1, rank=0))))
    assert not torch.equal(torch.get_rng_state(), before)

    again = ElasticDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    again.load_state_dict(state)
    torch.manual_seed(7)
    again.note_resume_rng(torch.get_rng_state())
    loader_it = iter(DataLoader(data, batch_size=4, sampler=again))
    torch.rand(1)  # the loop's own draw
    mine = torch.get_rng_state()
    next(loader_it)
    assert torch.equal(torch.get_rng_state(), mine)
