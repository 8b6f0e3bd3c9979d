"""Several optimizers, ``torch.compile``, FSDP2 and a GradScaler that skips steps work with the hook (what
``docs/api.md`` "Works with" says).

Real ``torchrun`` (2 ranks, gloo, CPU): a notice at step 4 (3 with the scaler) -> both ranks commit one
checkpoint and exit 143; the resumed run's losses (and scales) equal the uninterrupted reference run's bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.storage import open_storage
from spotguard.storage.commit import scan

from ._torchrun import TorchRun

SCRIPT = Path(__file__).resolve().parent / "_models_train.py"
STEPS = 10

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["two-opts", "compile", "fsdp2", "scaler"])
def test_preempt_and_resume_bitwise(variant: str, tmp_path: Path) -> None:
    store = str(tmp_path / "ckpt")
    # the scaler's skips come at steps 1, 5, 9 and it grows at 4, 8: stopping at 3 leaves a scale and growth
    # count that a scaler started afresh would not reproduce (at 4 it would, by coincidence)
    notify = 3 if variant == "scaler" else 4
    args = ["--variant", variant, "--storage", store, "--steps", str(STEPS)]
    pre = TorchRun(tmp_path / "pre.log", [*args, "--phase", "pre", "--notify-at", str(notify)], script=SCRIPT)
    assert pre.wait(180) != 0, pre.tail()
    ref = {e["ref"]: (e["hex"], e.get("scale")) for e in pre.lines() if "ref" in e}
    assert sorted(ref) == list(range(STEPS)), pre.tail()
    exits = {e["rank"]: e for e in pre.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), pre.tail()
    [stop] = [c.step for c in scan(open_storage(store)) if c.committed]
    # The notice is handed over at the start of iteration 4 (4 completed). One optimizer: agreed in the
    # background at once, the checkpoint stands for those 4. Two optimizers: the step-boundary path decides
    # at iteration 4's optimizer step, so it stands for the end of iteration 4 (5 completed).
    assert stop == (notify + 1 if variant == "two-opts" else notify), stop
    if variant == "scaler":  # skipped optimizer steps on both sides of the stop: the clock is scaler.update()
        scales = [ref[i][1] for i in range(STEPS)]
        drops = [i for i in range(1, STEPS) if scales[i] < scales[i - 1]]
        assert any(i < stop for i in drops) and any(i > stop for i in drops), scales
    via = {e.get("via") for e in pre.events("agreed")}
    assert via == ({None} if variant == "two-opts" else {"background"}), via
    if variant == "fsdp2":  # read off the training thread from FSDP2's sharded parameters, no module hook run
        staged = pre.events("checkpoint_staged")
        assert {e["rank"] for e in staged} == {0, 1} and {e["tensors_from"] for e in staged} == {"background"}, \
            staged

    res = TorchRun(tmp_path / "res.log", [*args, "--phase", "resume"], script=SCRIPT)
    assert res.wait(180) == 0, res.tail()
    assert {e["rank"]: e["step"] for e in res.events("resumed")} == {0: stop, 1: stop}, res.tail()
    got = {e["step"]: (e["hex"], e.get("scale")) for e in res.lines() if "hex" in e and "step" in e and "ref" not in e}
    assert sorted(got) == list(range(stop, STEPS)), res.tail()
    assert {k: ref[k] for k in got} == got, "resumed losses differ from the uninterrupted run"


def test_compiled_and_plain_modules_load_each_others_checkpoints(tmp_path: Path) -> None:
    """One process: a checkpoint written through ``torch.compile(net)`` loads into the plain module, and back."""
    from datetime import timedelta

    import torch

    from spotguard.hook import Hook, Preempted
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow
    from .test_boundary import boundary_path

    def train(model: torch.nn.Module, store: Path, notice_at: int) -> torch.nn.Module:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with boundary_path():  # an in-process notice: the step-exact boundary path
            hook = Hook({"model": model, "optimizer": opt}, str(store), signals=False, intake=False)
        try:
            for i in range(hook.resume(), 6):
                if i == notice_at:
                    now = utcnow()
                    hook.notify(Notice(id=f"drill-{store.name}", source="drill", kind="preemption",
                                       deadline=now + timedelta(seconds=30), received_at=now))
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
        except Preempted:
            pass
        finally:
            hook.close()
        return model

    for first_compiled in (True, False):
        store = tmp_path / f"c{int(first_compiled)}"
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        saved = train(torch.compile(net, backend="eager") if first_compiled else net, store, 2)
        torch.manual_seed(1)
        other = torch.nn.Linear(4, 1)
        fresh = torch.compile(other, backend="eager") if not first_compiled else other
        opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        hook = Hook({"model": fresh, "optimizer": opt}, str(store), signals=False, intake=False)
        try:
            assert hook.resume() == 3
        finally:
            hook.close()
        assert torch.equal(other.weight, net.weight) and torch.equal(other.bias, net.bias)
        del saved
