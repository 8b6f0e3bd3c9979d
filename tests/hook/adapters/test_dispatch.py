"""Dispatch by type name, the TypeError for unsupported objects, and in-process adapter checks (1 process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from spotguard import Preempted, install_preemption_hook
from spotguard.hook import adapters


def test_unsupported_object_is_a_type_error_listing_what_is_supported() -> None:
    class Mystery:
        pass

    with pytest.raises(TypeError) as err:
        install_preemption_hook(Mystery(), storage="/tmp/unused")
    msg = str(err.value)
    assert "Mystery" in msg
    for name in ("dict of stateful objects", "Lightning", "transformers.Trainer", "accelerate.Accelerator", "Ray"):
        assert name in msg, msg
    assert "(not yet)" not in msg


def test_detection_imports_no_framework() -> None:
    before = set(sys.modules)
    assert adapters.find(object()) is None
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("lightning", "transformers", "ray")}


def test_ray_torch_trainer_gets_a_pointer_to_the_worker_loop() -> None:
    pytest.importorskip("ray.train")
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    with pytest.raises(TypeError, match="train_loop_per_worker"):
        install_preemption_hook(trainer, storage="/tmp/unused")


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_single_process_notice_preempts_and_resumes(package: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Both package names: the callback subclasses the right Callback; a notice -> commit -> Preempted."""
    pl = pytest.importorskip(package)
    import torch

    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow
    from datetime import timedelta

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))

    class M(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            if self.global_step == 3:
                hook.notify(Notice(id="n-1", source="drill", kind="preemption",
                                   deadline=utcnow() + timedelta(seconds=30)))
            return self.lin(torch.ones(2, 4)).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer() -> object:
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))

    data = [torch.zeros(1)] * 4
    t = trainer()
    hook = install_preemption_hook(t, storage=str(tmp_path / "ckpt"))
    assert isinstance(hook.callback, importlib_callback(package))
    with pytest.raises(Preempted) as exc:
        t.fit(M(), train_dataloaders=data)
    assert exc.value.code == 143 and exc.value.committed
    stop = exc.value.step
    assert 3 < stop <= 5
    assert t.should_stop

    t2 = trainer()
    hook = install_preemption_hook(t2, storage=str(tmp_path / "ckpt"))
    assert t2.ckpt_path == hook.latest() and hook.latest().endswith(f"step-{stop:08d}/lightning.ckpt")
    # Replay of the same notice after the restart: exit at once, no second checkpoint.
    hook.notify(Notice(id="n-1", source="drill", kind="preemption", deadline=utcnow() + timedelta(seconds=30)))
    with pytest.raises(Preempted):
        t2.fit(M(), train_dataloaders=data)
    assert t2.global_step == stop
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [f"step-{stop:08d}"]
    os.environ.pop("SPOTGUARD_SOCKET", None)


def importlib_callback(package: str) -> type:
    import importlib

    return importlib.import_module(f"{package}.callbacks").Callback
