"""A hook closed while its process goes on (a sweep, a notebook, a second ``train()``) ends its attempt then."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spotguard.history import read_history
from spotguard.report.figures import compute
from spotguard.storage import open_storage

CHILD = textwrap.dedent("""
    import sys, time, torch
    from spotguard import install_preemption_hook

    for k in range(2):  # two trainings, one after the other, in one process
        net = torch.nn.Linear(2, 1)
        hook = install_preemption_hook({"model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)},
                                       storage=sys.argv[1])
        hook.resume()
        hook.close()
        time.sleep(0.2)
""")


def test_closing_a_hook_ends_its_attempt_at_the_close(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=120, env={"SPOTGUARD_SOCKET": str(tmp_path / "none.sock"),
                                           "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    events = read_history(open_storage(str(tmp_path / "ckpt"))).events
    fig = compute(events)
    assert len(fig.attempts) == 2
    first, second = fig.attempts
    assert first.end_kind == "process_end" and first.end <= second.start, (first, second)
    assert [e.kind for e in events].count("exit") == 2


FORKED = textwrap.dedent("""
    import os, sys, time
    from spotguard.history import HistoryWriter
    from spotguard.storage import open_storage

    w = HistoryWriter(open_storage(sys.argv[1]), rank=0)
    w.record("hook_installed", {"world_size": 1})
    assert w.flush(10)
    pid = os.fork()
    if pid == 0:  # a helper process forked by the training script, ending normally (atexit runs)
        sys.exit(0)
    t0 = time.monotonic()
    os.waitpid(pid, 0)
    print(f"child {time.monotonic() - t0:.3f}", flush=True)
""")


@pytest.mark.serial
def test_a_forked_child_ending_normally_is_not_the_attempts_end(tmp_path: Path) -> None:
    """The child inherits the writer but not its thread: its atexit must neither write nor wait for one."""
    out = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    seconds = float(out.stdout.split()[-1])
    assert seconds < 0.5, f"the forked child waited {seconds} s for a writer thread it does not have"
    kinds = [e.kind for e in read_history(open_storage(str(tmp_path))).events]
    assert kinds == ["hook_installed", "exit"]  # the parent's own process end, once


def test_history_off_writes_nothing_under_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPOTGUARD_HISTORY=0``: the hook writes no history entry (and the same hook with it on does)."""
    import torch  # noqa: PLC0415

    from spotguard import install_preemption_hook  # noqa: PLC0415

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "none.sock"))
    for value, store in (("0", tmp_path / "off"), ("1", tmp_path / "on")):
        monkeypatch.setenv("SPOTGUARD_HISTORY", value)
        net = torch.nn.Linear(2, 1)
        hook = install_preemption_hook({"model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)},
                                       storage=str(store))
        hook.resume()
        hook.close()
    assert open_storage(str(tmp_path / "off")).list("history/") == []
    assert [e.kind for e in read_history(open_storage(str(tmp_path / "on"))).events] == \
        ["hook_installed", "resumed", "exit"]
