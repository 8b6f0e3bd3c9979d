"""The user's own automatically named ``save_state()`` redone after a resume (``adapters/accelerate_own.py``).

make-test sibling of the oracle's ``accelerate-accum-notice-in-own-save-state`` (EXO_MORE): a real Accelerator (one
CPU process, in a subprocess: Accelerate's state is process-wide) wrote ``checkpoint_0`` and ``checkpoint_1``; a
resume restored the iteration as of ``checkpoint_0``'s moment, so the next save is ``checkpoint_1`` again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

_SCRIPT = r'''
import json, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from spotguard.hook.adapters.accelerate_own import replace_stale_own_checkpoints

class Log:
    lines = []
    def info(self, event, **kw):
        self.lines.append(event)

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                  automatic_checkpoint_naming=True, total_limit=3))
model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
acc.save_state()
acc.save_state()  # checkpoint_1: written after the step the resume stands for
acc.project_configuration.iteration = 1  # the resume's iteration (spotguard_iteration.json)
try:
    acc.save_state()
    bug = None
except ValueError as exc:
    bug = str(exc)
log = Log()
replace_stale_own_checkpoints(acc, 1, lambda: log)
acc.project_configuration.automatic_checkpoint_naming = False  # as spotguard's own saves: nothing removed
acc.save_state(sys.argv[1] + "/explicit")
acc.project_configuration.automatic_checkpoint_naming, acc.project_configuration.iteration = True, 1
marker = __import__("pathlib").Path(sys.argv[1], "checkpoints", "checkpoint_1", "stale")
marker.write_text("x")
acc.save_state()  # the redone checkpoint_1
print(json.dumps({"bug": bug, "events": log.lines, "wrapped": "save_state" in acc.__dict__,
                  "iteration": acc.project_configuration.iteration, "stale_left": marker.exists()}))
'''


def test_redone_own_save_replaces_the_folder_the_thrown_away_work_wrote(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bug"] and "already exists" in res["bug"]  # what Accelerate does without the replacement
    assert res["events"] == ["own_checkpoints_replaced"]
    assert not res["wrapped"] and res["iteration"] == 2 and not res["stale_left"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]


_LATER = r'''
import json, pathlib, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from spotguard.hook.adapters.accelerate_own import replace_stale_own_checkpoints

class Log:
    lines = []
    def info(self, event, **kw):
        self.lines.append((event, kw["folders"]))

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                  automatic_checkpoint_naming=True))
model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
for _ in range(3):
    acc.save_state()  # checkpoint_0, 1, 2: 1 and 2 by a run that went on after the checkpoint resumed from
ck = pathlib.Path(sys.argv[1], "checkpoints")
for k in (1, 2):
    (ck / f"checkpoint_{k}" / "mark").write_text("x")
acc.project_configuration.iteration = 1  # the resume's iteration
log = Log()
replace_stale_own_checkpoints(acc, 1, lambda: log)
acc.save_state()  # the redone checkpoint_1
after_first = sorted((p.parent.name for p in ck.glob("*/mark")))
acc.save_state()  # the redone checkpoint_2
print(json.dumps({"after_first": after_first, "after_second": sorted(p.parent.name for p in ck.glob("*/mark")),
                  "events": log.lines, "wrapped": "save_state" in acc.__dict__}))
'''


def test_redone_own_save_removes_only_the_folder_it_writes(tmp_path: Path) -> None:
    """Review (obrev): resumed from a checkpoint after which the run went on (an ordinary or periodic one, then a
    crash), the later ``checkpoint_<k>`` folders are that run's progress, not only thrown-away micro-batches':
    the first redone save removed all of them at once (a crash right after left the user with none of the newer
    ones). Each redone save now replaces only the folder it writes."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run([sys.executable, "-c", _LATER, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["after_first"] == ["checkpoint_2"], res  # checkpoint_1 rewritten, checkpoint_2 kept until redone
    assert res["after_second"] == [] and not res["wrapped"], res
    assert res["events"] == [["own_checkpoints_replaced", ["checkpoint_1"]],
                             ["own_checkpoints_replaced", ["checkpoint_2"]]], res
