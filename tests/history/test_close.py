"""A hook closed while its process goes on (a sweep, a notebook, a second ``train()``) ends its attempt then."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
