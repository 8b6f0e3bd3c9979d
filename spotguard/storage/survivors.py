"""Notice-aware save planning: replicated items are written by the ranks that survive the notice.

Why: usually one spot VM of a job is reclaimed, not all of them. DCP's stock
plan spreads every replicated item (a DDP model and its optimizer, the same
bytes on every rank) over all ranks by size, so the doomed node writes about a
world-size share of the whole state against its deadline. Those bytes exist on
the survivors too, and the survivors have no deadline of their own: given them,
the doomed ranks write only what exists nowhere else (their per-rank state:
RNG, loader position, per-rank stateful objects — kilobytes), and are safe
almost at once whatever the state size.

How, through DCP's own planner (not a rewrite): ``create_global_plan`` runs on
the coordinator with every rank's local plan (indexed by rank in the save's
process group). Before the stock dedup, an item that some surviving rank also
plans to write is taken out of every doomed rank's plan; the stock dedup then
balances what is left among the survivors as usual. An item only a doomed rank
holds (its per-rank blob, an FSDP shard) stays with it. No doomed rank, or
every rank doomed: the plans pass through untouched (the stock behaviour).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["SurvivorsPlanner", "survivors_only"]


def survivors_only(plans: list[SavePlan], doomed: "frozenset[int] | set[int]") -> list[SavePlan]:
    """``plans`` (one per rank) with every item a surviving rank also holds removed from the doomed ranks'
    plans; unchanged when no rank, or every rank, is doomed."""
    doomed = frozenset(r for r in doomed if 0 <= r < len(plans))
    if not doomed or len(doomed) == len(plans):
        return plans
    held = {item.index for r, p in enumerate(plans) if r not in doomed for item in p.items}
    return [dataclasses.replace(p, items=[i for i in p.items if i.index not in held]) if r in doomed else p
            for r, p in enumerate(plans)]


class SurvivorsPlanner(DefaultSavePlanner):
    """DCP's stock save planner, plus: replicated items go to surviving ranks only (``survivors_only``), and an
    optional cancellation point per write item (``cancel()`` raises to give the save up)."""

    def __init__(self, doomed: "Optional[frozenset[int]]" = None, cancel: Any = None) -> None:
        super().__init__()
        self.doomed = frozenset(doomed or ())
        self.cancel = cancel

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return super().create_global_plan(survivors_only(all_plans, self.doomed))

    def resolve_data(self, write_item: Any) -> Any:
        if self.cancel is not None:
            self.cancel()
        return super().resolve_data(write_item)
