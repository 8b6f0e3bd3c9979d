"""Lightning's ``DeepSpeedStrategy`` in this process, no training: what the hook checks before anything loads.

A Trainer with the strategy constructs on CPU (Lightning refuses the CPU only at ``fit``), which is all these
need; the training itself is ``test_lightning_deepspeed.py`` (torchrun).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")
pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, scope="module")
def _no_stale_deepspeed_groups() -> Iterator[None]:
    """DeepSpeed keeps the process groups it built in module globals (``deepspeed.utils.groups``); an earlier
    in-process test whose default group was destroyed (test_deepspeed_inproc's emergency exit) leaves them
    pointing at a group torch no longer knows, and the next ``deepspeed.initialize`` fails with "Group ... is
    not registered". Forget them, as a fresh process would."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    def forget() -> None:
        for name, value in list(vars(groups).items()):
            if not name.startswith("_") or not name.endswith(("GROUP", "GROUP_RANKS")):
                continue
            if isinstance(value, dict):
                setattr(groups, name, {})
            elif value is not None and not isinstance(value, (int, str, bool)):
                setattr(groups, name, None)

    if not dist.is_initialized():
        forget()
    yield
    forget()


def _trainer() -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return Trainer(strategy=DeepSpeedStrategy(stage=2), accelerator="cpu", devices=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _two_rank_checkpoint(root: Path, step: int) -> Path:
    """A committed Lightning-DeepSpeed checkpoint whose record says 2 ranks wrote it (contents never read)."""
    from spotguard.storage import open_storage
    from spotguard.storage.commit import CommitRecord, commit, prepare_attempt

    store = open_storage(str(root))
    key = prepare_attempt(store, step)
    for name in ("latest", "checkpoint/mp_rank_00_model_states.pt",
                 *(f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))):
        store.write_bytes(f"{key}/lightning.ckpt/{name}", b"not loaded")
    commit(store, step, CommitRecord(step=step, world_size=2, reason="emergency"))
    return root / f"step-{step:08d}" / "lightning.ckpt"


def test_a_two_rank_checkpoint_the_user_names_is_refused_on_one_rank_before_deepspeed_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own ``ckpt_path`` (set before install: the hook's automatic resume stands aside, so its
    install-time check does not run) naming a spotguard checkpoint of another world size: refused by name at
    Lightning's load, not handed to DeepSpeed (whose ZeRO-2 load may re-partition the fp32 weights while the
    optimizer moments stay the other world's)."""
    from spotguard import install_preemption_hook
    from spotguard.hook.adapters.deepspeed import DeepSpeedWorldSizeChanged

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    path = _two_rank_checkpoint(tmp_path / "other-run", 5)
    trainer = _trainer()
    trainer.ckpt_path = str(path)
    hook = install_preemption_hook(trainer, storage=str(tmp_path / "ckpt"))
    try:
        assert type(hook).__name__ == "LightningDeepSpeedHook"
        hook._arm()  # what the callback's setup("fit") does: the load is wrapped from here on
        with pytest.raises(DeepSpeedWorldSizeChanged, match="written by 2 ranks, this job has 1"):
            trainer.strategy.load_checkpoint(str(path))
    finally:
        hook.close()


def test_the_hooks_own_newest_checkpoint_of_another_world_size_is_refused_at_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The automatic resume's check (install) still holds."""
    from spotguard import install_preemption_hook
    from spotguard.hook.adapters.deepspeed import DeepSpeedWorldSizeChanged

    monkeypatch.setenv("SPOTGUARD_SOCKET", str(tmp_path / "no.sock"))
    _two_rank_checkpoint(tmp_path / "ckpt", 3)
    with pytest.raises(DeepSpeedWorldSizeChanged, match="written by 2 ranks, this job has 1"):
        install_preemption_hook(_trainer(), storage=str(tmp_path / "ckpt"))


def _one_rank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank of a torchrun-like job in this process (Lightning creates the gloo group inside ``fit``)."""
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SPOTGUARD_SOCKET": str(tmp_path / "no.sock"),
                 "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(k, v)
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):  # the comm op `make deepspeed-tools` prebuilt
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))


def _net(samples: int) -> Any:
    """A LightningModule class: a linear layer, AdamW, ``samples`` random rows in batches of 2."""
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, TensorDataset

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.randn(samples, 4)), batch_size=2)

    return Net


def _cpu_trainer(**kw: Any) -> Any:
    """A Trainer with the TESTING-ONLY CPU subclass of the strategy (``lightning_ds_train.py``), ZeRO-2."""
    from lightning.pytorch import Trainer

    from .lightning_ds_train import CPUDeepSpeedStrategy

    strategy = CPUDeepSpeedStrategy(stage=2, process_group_backend="gloo",
                                    config={"zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": False,
                                            "train_micro_batch_size_per_gpu": 2})
    kw.setdefault("enable_checkpointing", False)
    return Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, **kw)


def test_accumulation_lightning_and_deepspeed_count_differently_is_said_at_train_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``accumulate_grad_batches`` not dividing the epoch: Lightning counts its accumulation per epoch (its
    optimizer steps restart at each epoch's batch 0), DeepSpeed across epochs (``micro_steps``, which its
    checkpoint does not hold), so from the second epoch on Lightning's step ends fall where DeepSpeed holds
    partly reduced gradients (checked here), and no checkpoint there can resume bitwise. The hook says so
    at train start, naming the fix, instead of the user finding it in the losses."""
    from lightning.pytorch import Callback

    from spotguard import install_preemption_hook

    _one_rank_env(tmp_path, monkeypatch)
    mid: list[int] = []
    warned: list[tuple[str, dict[str, Any]]] = []

    class Watch(Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:  # the hook is armed (its log exists)
            warn = hook._log.warning
            monkeypatch.setattr(hook._log, "warning", lambda ev, **kw: (warned.append((ev, kw)), warn(ev, **kw)))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            engine = trainer.strategy.deepspeed_engine
            if (idx + 1) % 2 == 0:  # Lightning's step end (its count restarts with each epoch)
                mid.append(int(engine.micro_steps) % int(engine.gradient_accumulation_steps()))

    trainer = _cpu_trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[Watch()])
    hook = install_preemption_hook(trainer, storage=str(tmp_path / "ckpt"))
    try:
        trainer.fit(_net(10)())  # 5 batches an epoch, 2 a step
    finally:
        hook.close()
    assert mid[:2] == [0, 0] and any(mid[2:]), mid  # the premise: epoch 1's step ends are mid-accumulation
    found = [kw for ev, kw in warned if ev == "lightning_deepspeed_accumulation_misaligned"]
    assert found and found[0]["batches_per_epoch"] == 5 and found[0]["accumulate_grad_batches"] == 2, warned


def test_a_damaged_newest_checkpoint_is_skipped_and_the_previous_one_resumed_through_spotguards_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``every=`` commits a checkpoint at each step; the newest one's ZeRO partition is then damaged (one byte):
    the next fit's automatic resume quarantines it and Lightning resumes from the previous one, at its step."""
    from lightning.pytorch import Callback

    from spotguard import install_preemption_hook

    _one_rank_env(tmp_path, monkeypatch)
    store = tmp_path / "ckpt"
    trainer = _cpu_trainer(max_steps=4)
    hook = install_preemption_hook(trainer, storage=str(store), every=0.001)
    try:
        trainer.fit(_net(32)())
    finally:
        hook.close()
    steps = sorted(int(d.name[5:]) for d in store.glob("step-*") if (d / "COMMIT.json").exists())
    assert steps[-2:] == [2, 3], steps  # the last step (4) ends the fit: no periodic save there
    part = store / "step-00000003" / "lightning.ckpt" / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    part.write_bytes(bytes(raw))

    started: dict[str, int] = {}

    class Start(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            started["step"] = int(trainer.global_step)

    trainer = _cpu_trainer(max_steps=4, callbacks=[Start()])
    hook = install_preemption_hook(trainer, storage=str(store))
    try:
        assert hook.latest() == str(store / "step-00000002" / "lightning.ckpt")
        trainer.fit(_net(32)())
    finally:
        hook.close()
    assert started["step"] == 2, started
    assert (store / "step-00000003" / "QUARANTINE.json").exists()


def test_a_notice_during_lightnings_own_checkpoint_is_written_for_that_step_with_spotguards_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ``ModelCheckpoint`` saving every step (its own ``engine.save_checkpoint``, DeepSpeed's torch
    writer, to its own folder) and a SIGTERM arriving inside that save of step 3 (Lightning registers its own
    SIGTERM handler in ``fit``; with one rank its ``SIGTERMException`` would come at the next batch, after the
    hook's exit, so this does not test the handler race, which needs 2 ranks: Lightning's broadcasts): spotguard's callback comes after
    Lightning's (it is added at install, after the Trainer put ``ModelCheckpoint`` last), so the same step end reads
    the agreement and writes step 3 with spotguard's writer, every file in the commit record; Lightning's own save
    finished first, in its folder, with none of the hook's files. The notice is written for the step it arrived in,
    as the DeepSpeed engine adapter does (before: the reduction launched there was read one step later: step 4).
    (Preempted tears the process group down: this test stays the module's last.)"""
    import os
    import signal

    from lightning.pytorch.callbacks import ModelCheckpoint

    from spotguard import Preempted, install_preemption_hook

    _one_rank_env(tmp_path, monkeypatch)
    seen: dict[str, int] = {}

    class NoticeInSave(ModelCheckpoint):
        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            if trainer.global_step == 3 and "at" not in seen:
                seen["at"] = 3
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning registered its own SIGTERM handler in fit
            super()._save_checkpoint(trainer, filepath)
            seen["lightning_saves"] = seen.get("lightning_saves", 0) + 1

    mc = NoticeInSave(dirpath=str(tmp_path / "lightning"), every_n_train_steps=1, save_top_k=-1)
    trainer = _cpu_trainer(max_steps=10, callbacks=[mc], enable_checkpointing=True)
    hook = install_preemption_hook(trainer, storage=str(tmp_path / "ckpt"))
    try:
        with pytest.raises(Preempted) as exc:
            trainer.fit(_net(32)())
    finally:
        hook.close()
    assert exc.value.committed and exc.value.step == 3, (exc.value, seen)
    assert seen["lightning_saves"] == 3, seen  # steps 1-3: Lightning's own, whole; then the hook's of step 3
    record = json.loads((tmp_path / "ckpt" / "step-00000003" / "COMMIT.json").read_text())
    want = {"lightning.ckpt/latest", "lightning.ckpt/checkpoint/mp_rank_00_model_states.pt",
            "lightning.ckpt/checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert want <= set(record["checksums"]), record
    assert (tmp_path / "lightning" / "epoch=0-step=3.ckpt" / "checkpoint").is_dir()  # Lightning's, untouched
    assert not list((tmp_path / "lightning").rglob("step-*")), "the hook's files in Lightning's folder"
