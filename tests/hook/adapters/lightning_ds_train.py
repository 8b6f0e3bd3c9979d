"""``examples/lightning_train.py --deepspeed STAGE`` on CPU: Lightning's DeepSpeedStrategy with a TESTING-ONLY subclass.

Lightning 2.6 runs ``DeepSpeedStrategy`` on CUDA only, in three places, none of them about DeepSpeed itself
(which trains ZeRO on CPU with ``DS_ACCELERATOR=cpu`` and gloo):

1. ``setup_environment`` raises unless the accelerator is a ``CUDAAccelerator``;
2. ``setup_distributed`` calls ``_validate_device_index_selection``, which wants one device index a rank (a CPU
   device has none);
3. ``_setup_model_and_optimizer`` passes ``argparse.Namespace(device_rank=root_device.index)`` to
   ``deepspeed.initialize``: ``None`` on CPU, which the engine compares with 0.

The subclass skips 1 and 2 (the rest of both methods as Lightning's) and gives DeepSpeed the local rank for 3.
Not for users: spotguard's support of the strategy is what is tested, on the only hardware a CPU session has.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402

import lightning_train  # noqa: E402


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """TESTING ONLY: Lightning's DeepSpeedStrategy on the CPU accelerator (see the module docstring)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # 1: no CUDA check

    def setup_distributed(self) -> None:
        reset_seed()  # 2: as Lightning's, without the device-index check
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed

        orig = deepspeed.initialize

        def initialize(*args: Any, **kwargs: Any) -> Any:  # 3: a device rank DeepSpeed can compare
            kwargs["args"] = argparse.Namespace(device_rank=self.local_rank)
            return orig(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        finally:
            deepspeed.initialize = orig


if __name__ == "__main__":
    sys.exit(lightning_train.main(deepspeed_strategy=CPUDeepSpeedStrategy))
