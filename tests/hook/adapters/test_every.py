"""``every=`` is honoured by every framework adapter (issue 18 item 1): real torchrun jobs, 2 ranks, gloo.

Each example runs with ``--every 1s`` and no notice at all; the framework's own
checkpoint must be committed periodically (reason ``periodic``, no notice id) while
training goes on to the end, and the newest one must be a folder the framework resumes from.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from spotguard.storage import open_storage
from spotguard.storage.commit import scan

from ._jobs import Job, losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CASES = [
    pytest.param("lightning_train.py", "lightning.ckpt", "lightning", (), id="lightning", marks=pytest.mark.long(
        reason="sibling in make test: [lightning-accumulate] (the same Lightning every= path, micro-batches on top)")),
    # micro-batches are agreement points too (issue 23): their reductions carry the periodic votes to the step
    pytest.param("lightning_train.py", "lightning.ckpt", "lightning", ("--accumulate", "2", "--batches-per-epoch", "40"),
                 id="lightning-accumulate"),
    pytest.param("hf_trainer_train.py", "trainer_state.json", "transformers", (), id="hf-trainer"),
    pytest.param("accelerate_train.py", "random_states_1.pkl", "accelerate", (), id="accelerate"),
]


@pytest.mark.parametrize("script, marker, module, extra", CASES)
def test_every_writes_periodic_framework_checkpoints(script: str, marker: str, module: str, extra: tuple[str, ...],
                                                     tmp_path: Path) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed")
    store = tmp_path / "ckpt"
    steps = 14
    job = Job(script, tmp_path / "every.log", ["--steps", str(steps), "--step-time", "0.3", "--storage", str(store),
                                               "--every", "1s", *extra])
    assert job.wait(180) == 0, job.tail()
    assert sorted(losses(job)) == list(range(steps)), job.tail()  # training was never stopped
    assert job.events("exit") == []
    done = [c for c in scan(open_storage(str(store))) if c.committed]
    assert len(done) >= 2, job.tail()  # ~4 s of training at one checkpoint a second
    for c in done:
        assert c.record is not None and c.record.reason == "periodic" and c.record.notice_id is None, c.record
        assert (store / c.dir / marker).is_file(), sorted(p.name for p in (store / c.dir).iterdir())
    assert all(0 < c.step < steps for c in done)
    started = [e for e in job.events("checkpoint_started", 0) if e.get("reason") == "periodic"]
    assert len(started) >= len(done)
