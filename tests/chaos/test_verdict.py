"""The chaos verdict fails a run that never committed, resumed from step 0, or let damage through (no torchrun)."""

from __future__ import annotations

from typing import Any

from .driver import verdict


def _good() -> dict[str, Any]:
    return {"preemptions": 5, "checkpoints_committed": 3, "preemptions_with_time_not_committed": [],
            "resumes_from_committed_step": 4, "resumes_owed": 4, "planted_code_ran": False,
            "outside_cache_touched": False, "resumes_from_incomplete": 0, "resumes_not_newest_committed": [],
            "hung_ranks": 0, "final_state_identical": True, "final_difference": None, "replays": {},
            "steps_lost_committed_max": 1}


def test_a_good_run_passes() -> None:
    assert verdict(_good()) == []


def test_no_commit_at_all_fails_even_with_an_identical_final_state() -> None:
    """Each cycle restarting from step 0 still ends bitwise identical: that alone must not pass."""
    s = {**_good(), "checkpoints_committed": 0, "resumes_from_committed_step": 0, "resumes_owed": 0}
    assert any("no checkpoint was committed" in b for b in verdict(s))


def test_a_preemption_with_time_that_did_not_commit_fails() -> None:
    assert verdict({**_good(), "preemptions_with_time_not_committed": [2]})


def test_missing_resumes_from_committed_steps_fail() -> None:
    assert verdict({**_good(), "resumes_from_committed_step": 3})


def test_damage_that_got_through_fails() -> None:
    assert verdict({**_good(), "planted_code_ran": True})
    assert verdict({**_good(), "outside_cache_touched": True})
