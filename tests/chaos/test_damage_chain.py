"""The short damaged-checkpoint chain (9 trials, keep 1..3, ~5 s) inside ``make test``; ``make chaos`` runs 36.

The rules of ``damage.trial`` must hold in every trial: each resume loads the newest
good checkpoint (or refuses when none is left), a damaged one is read in full at most
once, each life's commit is there and good afterwards (also at a damaged step), at most
``keep`` good ones are kept, and the final state equals an uninterrupted run's bitwise.
Checked to fail 7 of 12 trials on the code before quarantine (issue 24).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .damage import render, run


def test_short_damaged_checkpoint_chain(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("SPOTGUARD_COMMIT_KEY", "set-by-run")  # run() sets its own; restored after the test
    summary = run(tmp_path, trials=9, seed=3)
    with capsys.disabled():
        print("\n" + render(summary))
    assert summary["trials"] == 9 and not summary["failed"], render(summary)
    kinds = {k.split("@")[0] for k in summary["injected"]}
    assert kinds == {"flip", "truncate", "forge_sizes", "forge_lineage"}, summary["injected"]
    assert {k.split("@")[1] for k in summary["injected"]} == {"newest", "copy"}
    assert summary["fallbacks"] >= 3 and summary["replaced"] >= 1, render(summary)
