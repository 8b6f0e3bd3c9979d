"""The notice-aware DCP plan (``storage/survivors.py``) on real DCP local plans, three "ranks" in one process.

Each rank's plan is what DCP's ``DefaultSavePlanner`` makes of its state dict: a replicated model (the same
FQNs on every rank, as under DDP), a per-rank blob, and one item only rank 1 holds (an FSDP shard of its own).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from spotguard.storage.survivors import SurvivorsPlanner


def _local_plans(world: int) -> list[Any]:
    plans = []
    for r in range(world):
        sd: dict[str, Any] = {"model.w": torch.ones(64, 64), "model.b": torch.ones(64), "lr": 0.1,
                              f"rank{r}": torch.tensor([r])}
        if r == 1:
            sd["only1"] = torch.zeros(8)
        p = DefaultSavePlanner()
        p.set_up_planner(sd, is_coordinator=r == 0)
        plans.append(p.create_local_plan())
    return plans


def _fqns(plan: Any) -> set[str]:
    return {i.index.fqn for i in plan.items}


def _global(doomed: Any) -> list[set[str]]:
    plans, _ = SurvivorsPlanner(doomed).create_global_plan(_local_plans(3))
    return [_fqns(p) for p in plans]


def test_doomed_rank_writes_only_what_no_survivor_holds() -> None:
    got = _global(frozenset({1}))
    assert got[1] == {"rank1", "only1"}
    assert got[0] | got[2] >= {"model.w", "model.b", "lr", "rank0", "rank2"}
    assert not (got[0] & got[2])  # the stock dedup still writes each replicated item once


def test_no_or_every_rank_doomed_is_the_stock_plan() -> None:
    stock, _ = DefaultSavePlanner().create_global_plan(_local_plans(3))
    want = [_fqns(p) for p in stock]
    assert any("model.w" in s or "model.b" in s for s in want[1:])  # the stock plan spreads replicated items
    assert _global(None) == want
    assert _global(frozenset({0, 1, 2})) == want


def test_doomed_ranks_from_the_agreement() -> None:
    """What the agreement's gather gives the plan: the flagged ranks, or None (stock plan) for none or all."""
    from spotguard.hook.doomed import doomed_ranks

    assert doomed_ranks([False, True, False]) == frozenset({1})
    assert doomed_ranks([False, False]) is None
    assert doomed_ranks([True, True]) is None


def test_cancel_is_asked_per_item() -> None:
    asked: list[int] = []
    p = SurvivorsPlanner(None, lambda: asked.append(1))
    p.set_up_planner({"x": torch.ones(2)}, is_coordinator=True)
    plan = p.create_local_plan()
    p.resolve_data(plan.items[0])
    assert asked == [1]


def test_hsdp_replicated_shards_go_to_the_replica_unique_shards_stay() -> None:
    """HSDP: 4 ranks, two replica groups {0, 1} and {2, 3}, each sharding ``w`` in two (offsets 0 and 32):
    rank 1 doomed gives its shard to rank 3 (the same shard in the other group) and keeps its per-rank blob;
    with rank 3 doomed too that shard exists nowhere else and stays where it is."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from spotguard.storage.survivors import survivors_only

    def shard(off: int) -> WriteItem:
        return WriteItem(index=MetadataIndex("w", torch.Size([off, 0])), type=WriteItemType.SHARD)

    def blob(r: int) -> WriteItem:
        return WriteItem(index=MetadataIndex(f"rank{r}"), type=WriteItemType.BYTE_IO)

    plans = [SavePlan([shard(0 if r % 2 == 0 else 32), blob(r)]) for r in range(4)]
    got = [{(i.index.fqn, tuple(i.index.offset or ())) for i in p.items} for p in survivors_only(plans, {1})]
    assert got[1] == {("rank1", ())}
    assert ("w", (32, 0)) in got[3]
    both = survivors_only([dataclasses.replace(p) for p in plans], {1, 3})
    assert [len(p.items) for p in both] == [2, 2, 2, 2]


def test_record_says_survivors_only_when_the_coordinator_planned_so() -> None:
    """A framework adapter writes its own format (Lightning: rank 0 writes everything) without the DCP planner:
    with rank 0 doomed the record must not claim that the survivors wrote the replicated state."""
    from spotguard.hook.doomed import writers_record

    doomed = frozenset({0})
    adapter = [{"bytes": 900, "seconds": 2.0, "doomed": True}, {"bytes": 0, "doomed": False}]
    assert writers_record(adapter, doomed)["plan"] == "all-ranks"
    dcp = [{**adapter[0], "bytes": 1, "planned": "survivors"}, {"bytes": 899, "planned": "survivors"}]
    assert writers_record(dcp, doomed)["plan"] == "survivors"


def test_a_notice_after_the_rounds_gather_joins_the_doomed_before_the_plan() -> None:
    """Two VMs preempted a moment apart: the round saw rank 1's notice only, rank 0's came during the staging
    copy. Asked again just before DCP plans, rank 0 is doomed too (every rank now: DCP's stock plan, not all
    the replicated bytes on a rank that is going as well); a rank the round saw doomed stays so."""
    from spotguard.hook.doomed import with_late_notices

    assert with_late_notices(frozenset({1}), [True, True]) is None
    assert with_late_notices(frozenset({1}), [True, False, False]) == frozenset({0, 1})
    assert with_late_notices(frozenset({1}), [False, False, False]) == frozenset({1})
    assert with_late_notices(None, [False, True]) == frozenset({1})
    assert with_late_notices(None, [False, False]) is None
