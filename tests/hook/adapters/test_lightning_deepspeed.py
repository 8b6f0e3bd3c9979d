"""Lightning's ``DeepSpeedStrategy`` (ZeRO-2), torchrun, 2 ranks, gloo, CPU: ``install_preemption_hook(trainer)``.

Lightning 2.6 runs the strategy on CUDA only; ``lightning_ds_train.py`` runs ``examples/lightning_train.py``
with a TESTING-ONLY subclass that lifts Lightning's three CUDA assumptions (its docstring names them). With
``every=1``: periodic checkpoints, then SIGTERM to rank 1 only (Lightning's own SIGTERM handler broadcasts on the default
group from inside the handler: spotguard's is put back over it); every rank's ZeRO partition is streamed into the
commit through spotguard's DeepSpeed ``CheckpointEngine``, and Lightning's own resume (through the same engine,
``weights_only=True``) ends bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")
pytest.importorskip("lightning.pytorch")

from ._jobs import Job, Reference, committed, read_log, resume_and_compare  # noqa: E402
from .test_deepspeed import ds_env  # noqa: E402,F401 - the CPU accelerator and the prebuilt comm op

SCRIPT = "../tests/hook/adapters/lightning_ds_train.py"  # Job runs examples/<script>
STEPS = 12
ARGS = ("--deepspeed", "2")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_zero2_every_then_sigterm_to_rank1_streams_every_partition_and_resumes_bitwise(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    ref = Reference(SCRIPT, tmp_path_factory.mktemp("lightning-ds-ref"), STEPS, ARGS)  # beside the preempted job
    store = tmp_path / "ckpt"
    run = Job(SCRIPT, tmp_path / "preempted.log",
              ["--steps", str(STEPS), "--step-time", "0.2", "--storage", str(store), "--every", "1", *ARGS])
    try:
        run.wait_for(lambda: any(e.get("reason") == "periodic" or str(e.get("notice_id")).startswith("periodic-")
                                 for e in run.events("checkpoint_committed")), 120, "a periodic checkpoint committed")
        run.signal_rank(1, signal.SIGTERM)  # Lightning registers its own SIGTERM handler (it broadcasts)
        assert run.wait(90) != 0
        agreed = {e["rank"]: e["step"] for e in run.events("agreed")}
        assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, (agreed, run.tail())
        stop = agreed[0]
        exits = {e["rank"]: e for e in run.events("exit")}
        assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), exits
        steps = committed(store)
        assert len(steps) >= 2 and steps[-1] == stop, steps
        folder = store / f"step-{stop:08d}"
        record = json.loads((folder / "COMMIT.json").read_text())
        assert record["reason"] == "emergency" and record["world_size"] == 2, record
        want = {"lightning.ckpt/latest", "lightning.ckpt/checkpoint/mp_rank_00_model_states.pt",
                *(f"lightning.ckpt/checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))}
        assert want <= set(record["files"]) and want <= set(record["checksums"]), record["files"]
        # Lightning's own SIGTERM path (handler broadcast + SIGTERMException) never ran: spotguard owned the signal
        assert "SIGTERMException" not in (tmp_path / "preempted.log").read_text()
        resume_and_compare(SCRIPT, tmp_path, ref, STEPS, stop, ARGS)
        loaded = read_log(tmp_path / "resumed.log").events("deepspeed_checkpoint_loaded")
        assert {e["rank"] for e in loaded} == {0, 1} and all(e["path"].endswith(f"step-{stop:08d}/lightning.ckpt")
                                                             for e in loaded), loaded  # through spotguard's reader
    finally:
        run.kill()
        ref.run.kill()
