"""The DeepSpeed adapter on a real one-rank ``DeepSpeedEngine`` in this process (gloo, CPU): install-time refusals.

One engine for the module (``deepspeed.initialize`` takes seconds; the comm op is the
prebuilt one in ``TORCH_EXTENSIONS_DIR``, never rebuilt here).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spotguard import install_preemption_hook  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ZeRO-2 engine on one rank (the process group is this module's; destroyed at its end)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        if not os.environ.get("TORCH_EXTENSIONS_DIR"):
            mp.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            mp.setenv(k, v)
        import deepspeed

        store = dist.FileStore(str(tmp_path_factory.mktemp("ds-inproc") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            deepspeed.init_distributed(dist_backend="gloo")
            net = torch.nn.Linear(4, 1)
            cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                   "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
            eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
            yield eng
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.parametrize("setting", ["zero_nvme_offload_optimizer", "load_universal_checkpoint"])
def test_nvme_offload_and_universal_load_are_refused_at_install(engine: Any, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                setting: str) -> None:
    """NVMe offload: DeepSpeed copies its swap folder with shutil into the (throw-away) save dir, outside the
    CheckpointEngine, so the commit would lack the optimizer state. ``checkpoint.load_universal``: DeepSpeed's
    load then expects the universal layout and reads it with ``torch.load(weights_only=False)``."""
    monkeypatch.setattr(engine, setting, lambda: True)
    with pytest.raises(NotImplementedError, match="nvme" if "nvme" in setting else "load_universal"):
        install_preemption_hook(engine, storage=str(tmp_path / "ckpt"))


def test_a_checkpoint_of_two_ranks_is_refused_on_one_before_anything_loads(engine: Any, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Elastic: a checkpoint committed by 2 ranks (its record says so; the files' contents do not matter, nothing
    may be read) is refused on this 1-rank job by name, and the engine keeps its state."""
    from spotguard.hook.adapters.deepspeed import DeepSpeedWorldSizeChanged
    from spotguard.storage import open_storage
    from spotguard.storage.commit import CommitRecord, commit, prepare_attempt

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    store = open_storage(str(tmp_path / "ckpt"))
    key = prepare_attempt(store, 5)
    for name in ("mp_rank_00_model_states.pt", "spotguard_rank0.pt", "spotguard_rank1.pt"):
        store.write_bytes(f"{key}/{name}", b"not loaded")
    commit(store, 5, CommitRecord(step=5, world_size=2, reason="emergency"))
    before, weights = int(engine.global_steps), [p.detach().clone() for p in engine.module.parameters()]
    hook = install_preemption_hook(engine, storage=str(tmp_path / "ckpt"))
    try:
        with pytest.raises(DeepSpeedWorldSizeChanged, match="written by 2 ranks, this job has 1"):
            hook.resume()
    finally:
        hook.close()
    assert int(engine.global_steps) == before
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters()))



def test_deepspeeds_own_loader_without_a_saved_position_is_warned_at_resume(
        engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deepspeed.initialize(training_data=...)`` gives a ``DeepSpeedDataLoader`` whose position nothing saves
    (no ``state_dict``, a plain ``DistributedSampler``): a resume would start its epoch over, silently not exact.
    Said at ``resume()`` when no ``add_state`` object could carry it."""
    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.ones(8, 4)))
    monkeypatch.setattr(engine, "training_dataloader", loader)
    hook = install_preemption_hook(engine, storage=str(tmp_path / "ckpt"))
    warned: list[tuple[str, dict[str, Any]]] = []
    warn = hook._log.warning
    monkeypatch.setattr(hook._log, "warning", lambda event, **kw: (warned.append((event, kw)), warn(event, **kw)))
    try:
        hook.resume()
    finally:
        hook.close()
    assert [kw for event, kw in warned if event == "deepspeed_data_position_not_saved"], warned

def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` hold the same values, recursively (tensors bitwise, objects by their attributes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


def test_the_any_moment_writer_writes_what_save_checkpoint_writes(engine: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The any-moment path writes DeepSpeed's files without ``save_checkpoint`` (no collective off the training
    thread): the same file names and, loaded, the same contents as ``save_checkpoint`` of the same step, so
    ``engine.load_checkpoint`` resumes from them as from DeepSpeed's own."""
    from spotguard.hook.adapters.deepspeed import SpotguardCheckpointEngine
    from spotguard.hook.periodic import stage_state_dict

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    hook = install_preemption_hook(engine, storage=str(tmp_path / "ckpt"))
    try:
        assert hook._ds_any, "ZeRO-2 without offload or accumulation takes the any-moment path"
        hook.resume()
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
            engine.step()
        step = int(engine.global_steps)
        assert hook._ds_small is not None and hook._ds_small[0] == step
        hook._ds_put("mine", hook._ds_files(hook._ds_small))  # an emergency's: from the live state
        # an ordinary notice's: from the host copy taken under the hold (review: training goes on meanwhile)
        hook._ds_put("staged", stage_state_dict(hook._ds_files(hook._ds_small))[0])
        hook._write("theirs", None)  # the boundary path: engine.save_checkpoint through the CheckpointEngine
    finally:
        hook.close()
    root = tmp_path / "ckpt"
    mine = sorted(p.name for p in (root / "mine").iterdir())
    assert mine == sorted(p.name for p in (root / "theirs").iterdir()), mine
    assert mine == sorted(p.name for p in (root / "staged").iterdir()), mine
    ce = SpotguardCheckpointEngine(hook.storage, "x", str(tmp_path))
    for name in mine:
        if name.startswith("spotguard_rank"):
            continue
        _same(ce.load(str(root / "mine" / name)), ce.load(str(root / "theirs" / name)), name)
        _same(ce.load(str(root / "staged" / name)), ce.load(str(root / "theirs" / name)), f"staged {name}")


def test_every_with_an_ema_updated_after_the_step_saves_it_with_that_update(engine: Any, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``every=`` and an EMA (a non-loader ``add_state`` object) updated right after ``engine.step()``: each periodic
    checkpoint of step N holds the EMA with update N (taken at the next training forward, on the boundary path:
    the any-moment path's periodic save runs at the end of ``engine.step()``, before the update), and an
    evaluation forward under ``no_grad`` in between is not that anchor."""
    import time

    from spotguard.hook.state import unpack
    from spotguard.storage import open_storage
    from spotguard.storage.commit import scan

    class Ema:
        def __init__(self) -> None:
            self.shadow = engine.module.weight.detach().clone()

        def state_dict(self) -> dict[str, Any]:
            return {"w": self.shadow.clone()}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.shadow.copy_(sd["w"])

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    ema = Ema()
    hook = install_preemption_hook(engine, storage=str(tmp_path / "ckpt"), every=0.3)
    after: dict[int, torch.Tensor] = {}
    try:
        hook.add_state("ema", ema)
        hook.resume()
        for _ in range(8):
            loss = engine(torch.ones(2, 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            with torch.no_grad():
                ema.shadow.lerp_(engine.module.weight.detach(), 0.5)
                engine(torch.ones(2, 4))  # an evaluation's forward: the post-step work goes on
                ema.shadow.add_(1.0)
            after[int(engine.global_steps)] = ema.shadow.clone()
            time.sleep(0.15)
    finally:
        hook.close()
    steps = [c.step for c in scan(open_storage(str(tmp_path / "ckpt"))) if c.committed]
    assert steps, "no periodic checkpoint"
    for n in steps:
        per = unpack((tmp_path / "ckpt" / f"step-{n:08d}" / "spotguard_rank0.pt").read_bytes(), "rank0")
        assert torch.equal(per["state"]["ema"]["w"], after[n]), (n, per["state"]["ema"]["w"], after[n])


def test_a_scheduler_the_loop_steps_given_to_add_state_is_saved_after_its_step(engine: Any, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch scheduler DeepSpeed does not own, stepped by the loop after ``engine.step()`` and handed to
    ``add_state``: the checkpoint of step N must hold it stepped N times (before: N-1, taken inside
    ``engine.step()``, so the resumed run used the previous step's learning rate). Following it must not put
    anything into its ``state_dict()`` (the user's own checkpoints of it). And the notice is acted on at the first
    step boundary after it, saving that step (before: the reduction launched there was read one step later, so a
    notice waited a whole extra step — time to safe (1 - phase) x T + T + save instead of (1 - phase) x T + save).
    (Preempted tears the module's process group down: this test stays the module's last.)"""
    from datetime import timedelta

    from spotguard import Preempted
    from spotguard.hook.state import unpack
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    # as on the torch optimizer a user gives deepspeed.initialize(optimizer=...): ZeRO's wrapper steps with its lr
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer.optimizer, step_size=1, gamma=0.5)
    first = int(engine.global_steps)  # the module's engine: the scheduler's steps count from here
    hook = install_preemption_hook(engine, storage=str(tmp_path / "ckpt"))
    try:
        hook.add_state("sched", sched)
        start = hook.resume()
        torch.save(sched.state_dict(), io.BytesIO())  # the user's own checkpoint of it still pickles
        with pytest.raises(Preempted) as exc:
            for step in range(start, start + 6):
                if step == start + 2:
                    hook.notify(Notice(id="n-sched", source="drill", kind="preemption",
                                       deadline=utcnow() + timedelta(seconds=30)))
                    at_notice = int(engine.global_steps)
                loss = engine(torch.ones(2, 4)).pow(2).mean()
                engine.backward(loss)
                engine.step()
                sched.step()
    finally:
        hook.close()
    assert exc.value.committed, exc.value
    stop = exc.value.step
    assert stop == at_notice + 1, (stop, at_notice)  # the step the notice arrived in, not the one after
    per = unpack((tmp_path / "ckpt" / f"step-{stop:08d}" / "spotguard_rank0.pt").read_bytes(), "rank0")
    assert per["state"]["sched"]["last_epoch"] == stop - first, (per["state"]["sched"], stop, first)
