"""Who receives a doomed rank's shards and when a doomed rank evacuates (``spotguard/hook/evacuate.py``):
pure functions, no process group (the wire itself is tested with real ``torchrun`` in ``test_doomed.py``)."""

from __future__ import annotations

import time

import pytest

from spotguard.hook.evacuate import DEFAULT_RATE, Evacuation, evacuate_mode, pair_ranks


def test_pairs_spread_over_the_survivors_only() -> None:
    assert pair_ranks(4, frozenset({1, 3})) == {1: 0, 3: 2}
    assert pair_ranks(4, frozenset({0, 1, 2})) == {0: 3, 1: 3, 2: 3}
    assert pair_ranks(2, frozenset({0, 1})) == {}  # every rank doomed: nobody to receive (today's path)
    # 4 nodes of 4 ranks, node 1 doomed: its ranks go to survivors spread over three nodes, not all to node 0
    assert pair_ranks(16, frozenset({4, 5, 6, 7})) == {4: 0, 5: 3, 6: 10, 7: 13}


def _role(rate: float | None, left: float) -> Evacuation:
    return Evacuation(None, 1, 2, frozenset({1}), None, "step-1", time.monotonic() + left, rate, None, {})


@pytest.mark.parametrize("mode,nbytes,rate,left,go", [
    ("auto", 100 << 20, 10 << 20, 15.0, True),  # 10 s at the measured rate > half of 15 s
    ("auto", 100 << 20, 10 << 20, 25.0, False),  # 10 s < half of 25 s: writes itself
    ("auto", 1 << 30, None, 30.0, False),  # unmeasured: DEFAULT_RATE (100 MiB/s) ~ 10 s < 15 s
    ("auto", 2 << 30, None, 30.0, True),  # ~20 s > 15 s
    ("always", 1, 10 << 20, 30.0, True),
    ("never", 1 << 40, 1.0, 1.0, False),
])
def test_auto_evacuates_when_the_direct_write_would_take_over_half_the_time_left(
        monkeypatch: pytest.MonkeyPatch, mode: str, nbytes: int, rate: float | None, left: float, go: bool) -> None:
    monkeypatch.setenv("SPOTGUARD_EVACUATE", mode)
    role = _role(rate, left)
    assert role.to == 0 and role.sources == []
    assert role.decide(nbytes) is go, role.why
    assert ("assumed" in role.why) == (rate is None) and DEFAULT_RATE == 100 << 20


def test_mode_knob_defaults_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_EVACUATE", raising=False)
    assert evacuate_mode() == "auto"
    monkeypatch.setenv("SPOTGUARD_EVACUATE", "bogus")
    assert evacuate_mode() == "auto"


def test_never_on_one_rank_still_tells_its_survivor(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPOTGUARD_EVACUATE`` is read per process: a doomed rank with ``never`` beside a survivor without it
    must still send its survivor the "I write myself" header (its role exists; ``decide`` says direct), or the
    survivor waits on it until the group's timeout and the whole save fails."""
    from spotguard.hook import evacuate
    from spotguard.hook.save import SaveMixin
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    asked: list[frozenset[int]] = []
    monkeypatch.setattr(evacuate.Evacuation, "for_save",
                        classmethod(lambda cls, group, doomed, *a, **k: asked.append(doomed) or "role"))
    monkeypatch.setenv("SPOTGUARD_EVACUATE", "never")
    me = SaveMixin()
    me._dist, me._storage, me._log, me._write_rate = True, None, None, None  # type: ignore[attr-defined]
    n = Notice(id="n", source="drill", kind="preemption", deadline=utcnow(), received_at=utcnow())
    assert me._evacuation(object(), frozenset({1}), "step-1", 0.0, n, 1) == "role"
    assert asked == [frozenset({1})]
    assert _role(None, 30.0).decide(1 << 40) is False  # and the doomed rank then writes itself


def test_the_serialised_file_is_held_once_in_host_memory() -> None:
    """A doomed rank serialises its shards into host memory: one copy of the file at the peak (tracemalloc
    sees Python's buffers, not the tensors), not the 2x of an initial buffer copied into ``BytesIO``; and the
    file is exactly what was written (no slack left at its end)."""
    import dataclasses
    import tracemalloc

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    from spotguard.hook.evacuate import _serialise

    planner = DefaultSavePlanner()
    planner.set_up_planner({"w": torch.ones(2 << 20), "b": torch.arange(5)}, is_coordinator=True)
    plan = dataclasses.replace(planner.create_local_plan(), storage_data=_StoragePrefix("__1_"))
    tracemalloc.start()
    try:
        results, files = _serialise(plan, planner)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    [(name, data)] = files.items()
    assert name == "__1_0.distcp" and len(results) == 2
    end = max(r.storage_data.offset + r.storage_data.length for r in results)
    assert len(data) == end > 8 << 20
    assert peak < 1.25 * len(data), (peak, len(data))
