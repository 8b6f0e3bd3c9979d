"""Scope rules and per-rank mapping for a resume on another world size (in process, no torchrun)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from spotguard.data import ElasticDistributedSampler
from spotguard.hook import elastic
from spotguard.hook.state import GLOBAL, PER_RANK, capture_rng, classify


class Box:
    """A user object with state: global by default."""

    def __init__(self, v: int = 0) -> None:
        self.v = v

    def state_dict(self) -> dict[str, int]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.v = sd["v"]


class MineOnly(Box):
    spotguard_scope = PER_RANK


class Feed(Box):
    """Iterable + stateful: a loader, per rank by default."""

    def __iter__(self) -> Any:
        return iter(())


def base() -> dict[str, Any]:
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return {"model": m, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2)}


def test_default_scopes_class_attribute_and_keyword() -> None:
    ds = list(range(8))
    s = ElasticDistributedSampler(ds, num_replicas=2, rank=0)
    objs = classify({**base(), "ema": Box(), "mine": MineOnly(), "feed": Feed(),
                     "data": DataLoader(ds, batch_size=2, sampler=s)})
    assert objs.scope == {"sched": GLOBAL, "ema": GLOBAL, "mine": PER_RANK, "feed": PER_RANK, "data": GLOBAL}
    assert objs.loaders["data"] is s  # the DataLoader stands for its sampler, which now counts its batches
    assert getattr(objs.loaders["data"]._loader(), "_get_iterator")._spotguard_counted
    over = classify({**base(), "ema": Box(), "feed": Feed()}, scope={"ema": PER_RANK, "feed": GLOBAL})
    assert over.scope["ema"] == PER_RANK and over.scope["feed"] == GLOBAL


@pytest.mark.parametrize("scope,match", [({"ema": "both"}, "must be"), ({"nope": GLOBAL}, "not a key"),
                                         ({"model": GLOBAL}, "resharded by DCP")])
def test_bad_scope_is_refused(scope: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        classify({**base(), "ema": Box()}, scope=scope)


def test_plain_dataloader_without_elastic_sampler_is_still_refused() -> None:
    ds = list(range(8))
    with pytest.raises(TypeError, match="state_dict"):
        classify({**base(), "data": DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0))})


def test_restore_new_rank_takes_globals_only() -> None:
    per = {"stateful": {"ema": {"v": 5}, "mine": {"v": 7}}, "loaders": {"feed": {"v": 9}}}
    roles = {"stateful": {"ema": Box(), "mine": MineOnly()}, "loaders": {"feed": Feed(), "gone": Feed()}}
    scope = {"ema": GLOBAL, "mine": PER_RANK, "feed": PER_RANK, "gone": GLOBAL}
    new = elastic.restore(per, own=False, source=0, roles=roles, scope=scope)
    assert (roles["stateful"]["ema"].v, roles["stateful"]["mine"].v, roles["loaders"]["feed"].v) == (5, 0, 0)
    assert (new.globals, new.fresh, new.missing) == (["ema"], ["mine", "feed"], ["gone"])
    own = elastic.restore(per, own=True, source=1, roles=roles, scope=scope)
    assert (roles["stateful"]["mine"].v, roles["loaders"]["feed"].v) == (7, 9)
    assert own.mapped == ["mine", "feed"]


def test_derived_rng_is_deterministic_distinct_and_not_a_copy() -> None:
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    rank0 = capture_rng()

    def draws(rank: int, step: int = 10) -> tuple[float, float, float]:
        elastic.derive_rng(rank0, step, rank)
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    a, b, again = draws(1), draws(2), draws(1)
    assert a == again and a != b and draws(1, step=11) != a
    random.setstate(rank0["python"]), np.random.set_state(rank0["numpy"]), torch.set_rng_state(rank0["torch"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) not in (a, b)


def test_saved_ranks_and_source() -> None:
    keys = ["model.w", "__spotguard__rank1", "__spotguard__rank0", "__spotguard__rankx", "x__spotguard__rank3"]
    assert elastic.saved_ranks(keys) == [0, 1]
    assert elastic.source_rank([0, 1], 1) == 1 and elastic.source_rank([0, 1], 3) == 0
    assert elastic.source_rank([], 0) is None
