"""Hostile or odd history objects: each is skipped and named, or yields sane figures; never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.history import Event, read_history
from spotguard.history.record import event_key
from spotguard.report.cli import build_figures
from spotguard.report.figures import compute, money
from spotguard.report.html import render_html
from spotguard.report.text import render_text
from spotguard.storage import open_storage

from .test_figures import B, chain, ev

R = "aaaaaaaaaaaa"


def _put(root: Path, t: float, kind: str, seq: int, fields: str, node: str = "n") -> str:
    """One stored entry with ``fields`` given as raw JSON text (what a hostile writer can put there)."""
    key = event_key(t, R, 0, seq)
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"v":1,"kind":"%s","time":%s,"run":"%s","rank":0,"local_rank":0,"node":%s,"fields":%s}'
                    % (kind, t, R, json.dumps(node), fields))
    return key


# valid JSON a parser accepts (1e999 is inf in Python's json) with values no writer produces
BAD_FIELDS = {
    "seq_text": ("hook_installed", '{"seq":"x"}'),
    "seq_list": ("hook_installed", '{"seq":[1]}'),
    "seq_inf": ("hook_installed", '{"seq":1e999}'),
    "step_inf": ("resumed", '{"step":1e999,"seq":2}'),
    "bytes_inf": ("periodic_committed", '{"step":3,"bytes":1e999,"seconds":1,"seq":2}'),
    "seconds_inf": ("periodic_committed", '{"step":3,"bytes":1,"seconds":-1e999,"seq":2}'),
    "code_inf": ("exit", '{"code":1e999,"seq":2}'),
    "world_size_inf": ("hook_installed", '{"world_size":1e999,"seq":1}'),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_non_finite_or_mistyped_numbers_are_skipped_and_named(tmp_path: Path, case: str) -> None:
    kind, fields = BAD_FIELDS[case]
    _put(tmp_path, 100, "hook_installed", 1, '{"world_size":1,"seq":1}')
    bad = _put(tmp_path, 101, kind, 2 if kind != "hook_installed" else 3, fields)
    _put(tmp_path, 102, "exit", 4, '{"code":0,"step":5,"reason":"process_end","seq":4}')
    hist = read_history(open_storage(str(tmp_path)))
    assert [k for k, _ in hist.skipped] == [bad]
    fig = build_figures(str(tmp_path), 1.0, 3.0)
    assert render_text(fig, "x") and render_html(fig, "x")
    json.dumps(fig, default=vars, allow_nan=False)


def test_out_of_range_values_give_sane_figures(tmp_path: Path) -> None:
    """A negative resume step, a process start in 1970 and negative seconds do not make the figures absurd."""
    _put(tmp_path, 1000, "hook_installed", 1, '{"world_size":1,"process_started":-1e300,"seq":1}')
    _put(tmp_path, 1001, "resumed", 2, '{"step":-1e300,"seconds":-5,"seq":2}')
    _put(tmp_path, 1050, "periodic_committed", 3, '{"step":10,"bytes":-7,"seconds":-2,"seq":3}')
    _put(tmp_path, 1100, "exit", 4, '{"code":-3,"step":20,"reason":"process_end","seq":4}')
    fig = build_figures(str(tmp_path))
    assert fig.wall_seconds == pytest.approx(100.0)
    assert fig.attempts[0].resume_step == 0 and fig.attempts[0].load_seconds == 0.0
    assert fig.step_seconds == pytest.approx(99.0 / 20)
    assert fig.checkpoint_bytes == 0 and fig.checkpoint_seconds == 0.0


def test_html_cuts_a_long_node_name_before_escaping_it() -> None:
    """A lane label is cut to 18 characters: cutting the escaped text would leave half an entity (``&am``)."""
    node = "node-0123456789<&>\"'x"
    page = render_html(compute([Event("hook_installed", 100, R, 0, node=node, fields={"seq": 1}),
                                Event("exit", 160, R, 0, node=node, fields={"seq": 2, "code": 0})]), "x")
    assert re.findall(r"&(?!(?:amp|lt|gt|quot|#x27);)", page) == []
    assert "node-0123456789&lt;&amp;&gt; rank 0" in page


def test_a_notice_seen_by_a_node_whose_clock_is_behind_belongs_to_rank0s_attempt() -> None:
    """Times come from different machines: the preemption's attempt is where rank 0 agreed on it."""
    evs = [e for e in chain() if not (e.run == B and e.kind in ("peers_lost", "exit"))]
    evs += [ev("notice_seen", 255, "b1b1b1b1b1b1", rank=1, node="n1", notice_id="n-2", source="gcp",
               kind="preemption", deadline="1970-01-01T00:06:50Z"),  # n1's clock is ~140 s behind
            ev("agreed", 395, B, notice_id="n-2", step=160, action="emergency", kind="preemption"),
            ev("checkpoint_committed", 396, B, notice_id="n-2", step=160, bytes=1, seconds=0.5,
               seconds_since_notice=1.0),
            ev("exit", 400.2, B, notice_id="n-2", code=143, step=160)]
    fig = compute(evs)
    assert [p.attempt for p in fig.preemptions] == [0, 1]
    assert fig.interruptions_without_notice == 0


def test_money_counts_each_attempts_own_nodes_after_an_elastic_resize() -> None:
    """One hour on 1 node, then (after a resize) one hour on 2: 3 node-hours, not 2 x the most nodes seen."""

    a, b = "a0a0a0a0a0a0", "b0b0b0b0b0b0"
    evs = [ev("hook_installed", 0, a, world_size=1, node="n0"), ev("resumed", 0, a, step=0),
           ev("exit", 3600, a, reason="peers_lost", code=69, step=100),
           ev("hook_installed", 3600, b, world_size=2, node="n0"),
           ev("hook_installed", 3600, "b1b1b1b1b1b1", rank=1, node="n1", world_size=2),
           ev("resumed", 3600, b, step=100), ev("exit", 7200, b, reason="process_end", step=300)]
    fig = compute(evs)
    assert [len(x.nodes) for x in fig.attempts] == [1, 2] and fig.nodes == 2
    m = money(fig, 1.0, 3.0)
    assert m["spot_node_hours"] == pytest.approx(3.0) and m["spot_cost"] == pytest.approx(3.0)
    assert m["on_demand_node_hours"] == pytest.approx(3.0)  # the same useful hours on the same nodes
    assert money(fig, 1.0, 3.0, nodes=4)["spot_node_hours"] == pytest.approx(8.0)  # --nodes: what the user says


@pytest.mark.parametrize("args", [["--price-spot", "-1", "--price-on-demand", "3"],
                                  ["--price-spot", "1", "--price-on-demand", "nan"],
                                  ["--price-spot", "1", "--price-on-demand", "3", "--nodes", "-2"]])
def test_negative_or_nan_prices_and_nodes_are_refused(tmp_path: Path, args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "spotguard", "report", str(tmp_path), *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr


def test_an_html_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "spotguard", "report", str(tmp_path), "--html",
                          str(tmp_path / "missing" / "r.html")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "r.html" in out.stderr, out.stderr
