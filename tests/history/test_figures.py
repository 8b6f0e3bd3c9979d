"""The report's arithmetic on a synthetic history whose every figure is worked out by hand below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotguard.history import Event
from spotguard.history.record import event_key
from spotguard.report.figures import compute, money
from spotguard.storage import open_storage

A, B, C = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"


def ev(what: str, t: float, run: str, rank: int = 0, node: str = "n0", **fields: Any) -> Event:
    return Event(kind=what, time=t, run=run, rank=rank, node=node, fields=fields)


def chain() -> list[Event]:
    """Attempt A preempted (AWS notice, deadline 320), B lost a peer (no notice), C ran to the end."""
    return [
        ev("hook_installed", 101, A, world_size=2, process_started=100.0),
        ev("hook_installed", 101.2, "a1a1a1a1a1a1", rank=1, node="n1", world_size=2, process_started=100.5),
        ev("resumed", 102, A, step=0, uri=None, seconds=0.0),
        ev("notice_seen", 200, "a1a1a1a1a1a1", rank=1, node="n1", notice_id="n-1", source="aws",
           kind="preemption", deadline="1970-01-01T00:05:20Z"),
        ev("agreed", 200.5, A, notice_id="n-1", step=98, action="emergency", kind="preemption"),
        ev("checkpoint_committed", 202, A, notice_id="n-1", step=98, bytes=1_000_000_000, seconds=1.5,
           seconds_since_notice=2.0),
        ev("exit", 202.5, A, notice_id="n-1", code=143, step=98, committed=True),
        ev("hook_installed", 262, B, world_size=2, process_started=260.0),
        ev("resumed", 265, B, step=98, uri="x/step-00000098", seconds=2.0),
        ev("periodic_committed", 380, B, step=150, bytes=500_000_000, seconds=1.0),
        ev("peers_lost", 400, B, lost_ranks=[1], step=160),
        ev("exit", 400.2, B, reason="peers_lost", code=69, step=160),
        ev("hook_installed", 501, C, world_size=2, process_started=500.0),
        ev("resumed", 503, C, step=150, uri="x/step-00000150", seconds=1.0),
        ev("exit", 700, C, reason="process_end", code=None, step=250),
    ]


def test_figures_of_a_hand_worked_chain() -> None:
    fig = compute(chain())
    assert len(fig.attempts) == 3
    assert fig.wall_seconds == pytest.approx(600.0)
    assert fig.training_seconds == pytest.approx(98.5 + 135.2 + 197.0)
    assert fig.step_seconds == pytest.approx(430.7 / 260)
    assert fig.steps_recomputed == 10  # B reached 160, C resumed from 150; A's notice lost nothing
    assert fig.goodput_seconds == pytest.approx(430.7 * 250 / 260)
    assert fig.goodput_percent == pytest.approx(100 * 430.7 * 250 / 260 / 600)
    assert len(fig.preemptions) == 1 and fig.preemptions_by == {"aws/preemption": 1}
    assert fig.preemptions[0].nodes == ["n1"] and fig.preemptions[0].step == 98
    assert fig.interruptions_without_notice == 1
    assert fig.time_to_safe_p50 == fig.time_to_safe_max == 2.0
    assert [round(d["seconds"], 3) for d in fig.downtime] == [62.5, 102.8]
    assert [round(d["waiting"], 3) for d in fig.downtime] == [57.5, 99.8]
    assert [round(d["restart_load"], 3) for d in fig.downtime] == [5.0, 3.0]
    assert fig.checkpoint_bytes == 1_500_000_000 and fig.throughput_mb_s == pytest.approx(600.0)
    assert fig.nodes == 2
    cf15 = fig.counterfactual[0]
    # A: trains to its deadline 320 (218 s since resume, no 15-min checkpoint yet): 218 s lost, 119.5 s more
    # trained; B: 135.2 s since its resume lost; wall grows by A's 117.5 s to the deadline
    assert cf15["every_minutes"] == 15 and cf15["lost_seconds"] == pytest.approx(353.2)
    assert cf15["goodput_percent"] == pytest.approx(round(100 * (430.7 + 119.5 - 353.2) / 717.5, 2))


def test_money_against_on_demand() -> None:
    fig = compute(chain())
    m = money(fig, 1.0, 3.0, 2)
    ran = 102.5 + 140.2 + 200.0
    assert m["spot_cost"] == pytest.approx(round(ran / 3600 * 2 * 1.0, 4))
    od = (430.7 * 250 / 260 + 2.0) / 3600 * 2 * 3.0
    assert m["on_demand_cost"] == pytest.approx(round(od, 4)) and m["saved"] == pytest.approx(round(od - ran / 1800, 4))


def test_empty_history_has_no_attempts() -> None:
    fig = compute([])
    assert fig.attempts == [] and fig.goodput_percent == 0.0


def test_cli_json_and_damaged_entry_named(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    for e in chain():
        store.write_bytes(event_key(e.time, e.run, e.rank, 1 + int(e.time * 10) % 999999), e.to_json())
    bad = event_key(650, C, 0, 7)
    store.write_bytes(bad, b'{"v": 1, "kind": "exit", "time": 650')  # torn write
    out = subprocess.run([sys.executable, "-m", "spotguard", "report", str(tmp_path), "--json",
                          "--price-spot", "1", "--price-on-demand", "3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["steps_recomputed"] == 10 and len(doc["preemptions"]) == 1 and doc["money"]["nodes"] == 2
    assert [k for k, _ in doc["skipped"]] == [bad] and bad in out.stderr
    text = subprocess.run([sys.executable, "-m", "spotguard", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0 and "Goodput" in text.stdout and bad in text.stdout


def test_cli_names_a_bad_uri_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "spotguard", "report", "foo://x"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unsupported storage URI" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("writers, shown", [
    ({"doomed": [1], "bytes_per_rank": [1_000_000_000, 28_000], "safe_seconds": {"1": 0.25}, "plan": "survivors"},
     "notice on rank 1: wrote 27.3 KiB, safe 0.25 s into the save; the others wrote 953.7 MiB"),
    ({"doomed": "1", "bytes_per_rank": {"x": 1}}, None),  # read from storage: wrong types say nothing
    ([1, 2], None),
])
def test_a_preemption_says_who_wrote_what_when_the_save_was_planned_around_the_doomed(
        writers: Any, shown: Any) -> None:
    events = chain()
    i = next(k for k, e in enumerate(events) if e.kind == "checkpoint_committed")
    events[i].fields["writers"] = writers
    fig = compute(events)
    assert fig.preemptions[0].writers == shown
    from spotguard.report.text import render_text  # noqa: PLC0415

    text = render_text(fig, "x")
    assert (shown in text) if shown else ("notice on rank" not in text)
