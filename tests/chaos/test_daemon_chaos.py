"""The short daemon chaos run inside ``make test`` (``make chaos`` runs 32 trials: every phase with each signal,
four times): four trials, the four kill phases once each, SIGKILL (before_delivery, after_commit) and SIGTERM alternating, each with the ASG,
webhook and Kubernetes actions against loopback fakes. ~35-60 s on 2 busy cores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="moto[server] missing: `make storage-tools` (requirements-storage.txt)")

from .daemon_chaos import PHASES, SIGNALS, run  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


def test_short_daemon_chaos_run(tmp_path: Path) -> None:
    summary = asyncio.run(run(4, 11, tmp_path))
    assert summary["trials"] == 4
    assert all(summary["by_phase"][p] == 1 for p in PHASES), summary["by_phase"]
    assert all(summary["by_signal"][s] == 2 for s in SIGNALS), summary["by_signal"]
    bad = [f"trial {r['trial']} ({r['phase']}, {r['signal']}): {'; '.join(r['violations'])}"
           for r in summary["results"] if r["violations"]]
    assert not bad, "\n".join(bad) + f"\nlogs: {tmp_path}"
