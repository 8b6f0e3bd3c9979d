"""The peer watch (``spotguard/hook/peers.py``) never takes a healthy job down: real 2-rank torchrun jobs.

The vanished-node behaviour itself (a frozen node ends in an exit) is tested with two torchrun nodes in
``tests/chaos/test_vanished_node.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.history import read_history
from spotguard.storage import open_storage

from ._torchrun import TorchRun

SCRIPT = Path(__file__).resolve().parent / "_peers_train.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _run(tmp: Path, mode: str, hold: float, timeout: float) -> TorchRun:
    run = TorchRun(tmp / f"{mode}.log", ["--mode", mode, "--hold", str(hold)], script=SCRIPT,
                   env={"SPOTGUARD_STORAGE": f"file://{tmp}/ckpt", "SPOTGUARD_PEER_TIMEOUT": str(timeout),
                        "SPOTGUARD_PEER_INTERVAL": "0.25"})
    run.wait(120)
    return run


def test_rank_holding_the_gil_below_the_timeout_is_not_lost(short_tmp: Path) -> None:
    """Rank 1's training thread holds the GIL 1.5 s (one C call): with a 5 s timeout nobody is declared lost."""
    run = _run(short_tmp, "gil", 1.5, 5.0)
    assert run.proc.returncode == 0, run.tail()
    assert [e["held_gil"] for e in run.lines() if "held_gil" in e][0] >= 1.5
    assert not run.events("peers_lost"), run.events("peers_lost")


def test_rank_holding_the_gil_past_the_timeout_is_named(short_tmp: Path) -> None:
    """The same hold past a 1 s timeout: the other rank names rank 1 and leaves with 69 (what a false alarm costs)."""
    run = _run(short_tmp, "gil", 3.0, 1.0)
    lost = run.events("peers_lost", rank=0)
    assert lost and lost[0]["lost_ranks"] == [1] and lost[0]["code"] == 69, run.tail()
    assert "rank 1 on" in lost[0]["detail"]
    assert run.proc.returncode != 0
    # the job's history (docs/report.md) says so too, written before the os._exit
    hist = [e for e in read_history(open_storage(str(short_tmp / "ckpt"))).events if e.rank == 0]
    assert [e.fields["lost_ranks"] for e in hist if e.kind == "peers_lost"] == [[1]], hist
    assert [(e.fields["reason"], e.fields["code"]) for e in hist if e.kind == "exit"] == [("peers_lost", 69)], hist


def test_rank_that_closed_its_hook_and_stays_alive_is_not_lost(short_tmp: Path) -> None:
    """Rank 1 closes its hook (a bye to the peers) and stays 3 s past a 1 s timeout: rank 0 keeps waiting."""
    run = _run(short_tmp, "bye", 3.0, 1.0)
    assert run.proc.returncode == 0, run.tail()
    assert any("closed_and_slept" in e for e in run.lines())
    assert not run.events("peers_lost"), run.events("peers_lost")


def test_bad_peer_timeout_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed SPOTGUARD_PEER_TIMEOUT is one warning naming the variable, never a crash or a zero timeout."""
    from spotguard.hook.peers import PEER_TIMEOUT, _env_seconds

    for raw in ("soon", "-1", "inf", "0.0"):
        monkeypatch.setenv("SPOTGUARD_PEER_TIMEOUT", raw)
        assert _env_seconds("SPOTGUARD_PEER_TIMEOUT", PEER_TIMEOUT) == PEER_TIMEOUT
    monkeypatch.setenv("SPOTGUARD_PEER_TIMEOUT", "7.5")
    assert _env_seconds("SPOTGUARD_PEER_TIMEOUT", PEER_TIMEOUT) == 7.5
    out = capsys.readouterr()
    assert "SPOTGUARD_PEER_TIMEOUT='soon' ignored" in out.out + out.err


def test_watch_is_off_without_a_process_group_or_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard.hook.peers import watch_peers

    assert watch_peers(object()) is None  # no torch.distributed: nothing to watch
