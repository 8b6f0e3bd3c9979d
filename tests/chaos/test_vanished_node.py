"""A node that vanishes (issue 14, item 3), the short version inside ``make test``; ``make chaos`` runs the grid.

Two torchrun agents ("nodes") x 2 ranks on loopback, c10d rendezvous on a separate store, local-folder
storage; node B frozen with SIGSTOP (no reset, like a powered-off VM) mid-iteration with no notice
(``tests/chaos/vanish.py``). The test asserts: node A's ranks all end within the stated bound (measured
from the freeze), through the peer watch (``peers_lost``, exit 69); every committed checkpoint verifies and
the newest is the one from before the freeze (nothing partial committed); a fresh job resumes from it.

The other points of the grid (B frozen mid-save of its notice, B frozen right after the commit of A's
notice: 143 on A, the new checkpoint resumed; the agreement; notices on either node) run in ``make chaos``
(``python -m tests.chaos.vanish``, ~8 trials of ~25-35 s), judged by the same ``vanish.judge``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from .vanish import exit_bound, judge, run_trial

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]

PEER_TIMEOUT = 3.0
# (point, where the notice is): a pure vanish mid-iteration (A's ranks in the user's DDP all-reduce). B frozen
# mid-save of a notice B had, and right after a commit of a notice A had: the grid in `make chaos`.
SHORT = [("iteration", "none")]


@pytest.mark.parametrize(("point", "notice"), SHORT, ids=[f"{p}-notice_{n}" for p, n in SHORT])
def test_node_b_frozen(point: str, notice: str, short_tmp: Path, capsys: Any) -> None:
    t = run_trial(point, notice, short_tmp / f"{point}-{notice}", peer_timeout=PEER_TIMEOUT, seed=14)
    with capsys.disabled():
        print(f"\nvanished node {point}/{notice}: node A exited {t.a_exit_seconds} s after the freeze "
              f"(codes {t.a_codes}, via {t.a_how}); newest committed {t.newest_step}, resumed {t.resumed_step}")
    assert not t.problems, json.dumps(asdict(t), indent=1) + f"\nlogs: {short_tmp}"
    bad = judge(t, PEER_TIMEOUT)
    assert not bad, "; ".join(bad) + "\n" + json.dumps(asdict(t), indent=1) + f"\nlogs: {short_tmp}"
    bound = exit_bound(PEER_TIMEOUT)
    assert t.a_exit_seconds is not None and t.a_exit_seconds <= bound, (t.a_exit_seconds, bound)
    assert set(t.a_how.values()) == {"peers_lost"}, t.a_how  # no notice: only the watch can end the wait
    assert set(t.a_codes.values()) == {69}, t.a_codes
    assert t.newest_step == t.expected_step and t.resumed_step == t.newest_step
    shutil.rmtree(short_tmp / f"{point}-{notice}", ignore_errors=True)
