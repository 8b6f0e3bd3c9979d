"""A process killed with SIGKILL (no ``exit`` event) still shows how long it trained and how far it got."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from spotguard.history import read_history
from spotguard.report.figures import compute
from spotguard.storage import open_storage

CHILD = textwrap.dedent("""
    import sys, time
    from spotguard.history import HistoryWriter, LogTap
    from spotguard.storage import open_storage

    class Quiet:
        def info(self, event, **kw): pass

    count = [0]
    w = HistoryWriter(open_storage(sys.argv[1]), rank=0, step_of=lambda: count[0])
    log = LogTap(Quiet(), w)
    log.info("hook_installed", world_size=1)
    log.info("resumed", step=0, uri=None, seconds=0.0)
    print("training", flush=True)
    while True:  # the training loop: no hook event per step
        count[0] += 1
        time.sleep(0.01)
""")


def test_a_killed_process_leaves_its_training_span_and_step(tmp_path: Path) -> None:
    env = {**os.environ, "SPOTGUARD_HISTORY_ALIVE": "0.3"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "training"
        store = open_storage(str(tmp_path))
        end = time.monotonic() + 15
        alive = []
        while time.monotonic() < end and not alive:  # the child's own record of its progress, read back
            alive = [e for e in read_history(store).events if e.kind == "alive" and e.fields.get("step", 0) >= 20]
            time.sleep(0.1)
        assert alive, "no alive entry with a step: a process killed now would leave only its start"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    events = read_history(store).events
    assert "exit" not in [e.kind for e in events]
    fig = compute(events)
    a = fig.attempts[0]
    assert a.end_kind == "vanished" and a.last_step >= 20
    assert a.training_seconds >= 0.15 and fig.step_seconds is not None
    assert len([e for e in events if e.kind == "alive"]) == 1  # one object per process, rewritten
