"""The DeepSpeed adapter's CheckpointEngine in one process: streaming to an object store, the trust rule."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make deepspeed-tools)")

import torch  # noqa: E402

from spotguard.hook.adapters.deepspeed import SpotguardCheckpointEngine  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402
from spotguard.storage.objstore import ObjectStoreError  # noqa: E402
from spotguard.storage.integrity import DamagedCheckpoint, digest_of  # noqa: E402



def _mem_store_class() -> type:
    """tests/storage's in-memory object store (not importable as a package from here: --import-mode=importlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sg_test_objstore",
                                                  Path(__file__).parents[2] / "storage" / "test_objstore.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MemStore  # type: ignore[no-any-return]


MemStore = _mem_store_class()

KEY = "step-00000007"


class _CountingStore(MemStore):  # type: ignore[misc, valid-type]
    """MemStore that counts multipart uploads (a file larger than a part must go as one)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.multipart: list[str] = []

    def _start_upload(self, name: str):  # type: ignore[no-untyped-def]
        self.multipart.append(name)
        return super()._start_upload(name)


class Foreign:
    """Not on any allowlist: a checkpoint naming it must not be unpickled."""


def test_object_store_save_streams_parts_and_logs_the_checksum(tmp_path: Path) -> None:
    store = _CountingStore(part_size=4096, concurrency=2)
    root = tmp_path / "save" / "ds"
    ce = SpotguardCheckpointEngine(store, KEY, str(root))
    state = {"module": {"w": torch.arange(20_000, dtype=torch.float32)}, "global_steps": 7}
    ce.save(state, str(root / "mp_rank_00_model_states.pt"))

    name = f"root/{KEY}/mp_rank_00_model_states.pt"
    data = store.objects[name]
    assert store.multipart == [name] and not store.open_uploads  # streamed in parts, not one buffered PUT
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "nothing may be staged on local disk"
    assert store.write_log.peek(KEY) == {"mp_rank_00_model_states.pt": digest_of(data)}
    back = torch.load(io.BytesIO(data), weights_only=True)
    assert back["global_steps"] == 7 and torch.equal(back["module"]["w"], state["module"]["w"])


def test_a_store_failing_mid_stream_leaves_nothing_and_raises(tmp_path: Path) -> None:
    """Parts fail for good after the first: the upload is aborted, no object and no write-log entry remain (the
    ranks' all-ok then fails and nothing is committed), and the store's error is what the save raises."""
    store = _CountingStore(part_size=4096, concurrency=2, max_attempts=2)
    root = tmp_path / "save" / "ds"
    ce = SpotguardCheckpointEngine(store, KEY, str(root))
    store.fail = 10**6
    with pytest.raises(ObjectStoreError, match="injected"):  # the store's error, not torch.save's broken stream
        ce.save({"w": torch.arange(20_000, dtype=torch.float32)}, str(root / "mp_rank_00_model_states.pt"))
    assert store.multipart and not store.objects and not store.open_uploads
    assert not store.write_log.peek(KEY) and not ce.written


def test_local_save_is_checksummed_as_written(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "ckpt"))
    root = tmp_path / "save" / "ds"
    ce = SpotguardCheckpointEngine(store, KEY, str(root))
    ce.save({"x": torch.ones(3)}, str(root / "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    path = tmp_path / "ckpt" / KEY / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert store.write_log.peek(KEY) == {path.name: digest_of(path.read_bytes())}
    with pytest.raises(ValueError, match="outside"):
        ce.save({}, str(tmp_path / "elsewhere.pt"))


def test_load_allows_deepspeeds_types_and_refuses_any_other(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    ce = SpotguardCheckpointEngine(open_storage(str(tmp_path / "ckpt")), KEY, str(tmp_path))
    ok = tmp_path / "ok.pt"
    # fp16's scaler (fp16 does not run on CPU: its checkpoint type is checked here), with its torch.dtype
    dyn = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                            consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.float16)
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(2.0), "dyn": dyn,
                "t": torch.ones(2)}, ok)
    got = ce.load(str(ok))
    assert got["zero_stage"] == ZeroStageEnum.gradients and got["loss_scaler"].cur_scale == 2.0
    assert vars(got["dyn"]) == vars(dyn)

    bad = tmp_path / "bad.pt"
    torch.save({"x": Foreign()}, bad)
    with pytest.raises(DamagedCheckpoint, match="refused to load"):
        ce.load(str(bad))


def test_lightning_deepspeed_strategy_gets_the_deepspeed_writer_and_plain_lightning_is_refused(tmp_path: Path) -> None:
    """A Trainer with ``DeepSpeedStrategy``: the Lightning adapter with DeepSpeed's writer (every rank's ZeRO
    partition streamed; end to end in test_lightning_deepspeed.py); the plain Lightning adapter refuses it."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from spotguard import install_preemption_hook
    from spotguard.hook.adapters.lightning import install as plain_install
    from spotguard.hook.adapters.lightning_deepspeed import LightningDeepSpeedHook

    trainer = pl.Trainer(strategy=DeepSpeedStrategy(stage=2), accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="DeepSpeedStrategy"):
        plain_install(trainer, storage=str(tmp_path / "ckpt"))
    hook = install_preemption_hook(trainer, storage=str(tmp_path / "ckpt"))
    try:
        assert type(hook) is LightningDeepSpeedHook
    finally:
        hook.close()
