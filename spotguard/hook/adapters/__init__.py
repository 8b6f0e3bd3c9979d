"""Framework adapters, found by the *name* of the trainer's type (or a base class).

Why by name: importing Lightning, transformers, accelerate, Ray or DeepSpeed just to run an
``isinstance`` check would cost seconds and pull frameworks the user does not
use. An adapter module is imported only once its type name matched.

Each entry maps a fully qualified class name to ``"module:function"``; the
function has the signature of ``install_preemption_hook`` and returns a hook.
Entries whose module is ``None`` are known frameworks without an adapter yet:
they get a clear ``NotImplementedError`` instead of a confusing ``TypeError``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Adapter", "register", "find", "supported"]


@dataclass(frozen=True)
class Adapter:
    type_names: tuple[str, ...]
    description: str
    target: Optional[str]  # "module:function", or None while not implemented

    def load(self) -> Callable[..., Any]:
        if self.target is None:
            raise NotImplementedError(
                f"{self.description} support is not implemented in this spotguard version yet; "
                "for now pass a dict of stateful objects (model, optimizer, scheduler, loader)"
            )
        mod, _, fn = self.target.partition(":")
        return getattr(importlib.import_module(mod), fn)


_REGISTRY: list[Adapter] = [
    Adapter(("lightning.pytorch.trainer.trainer.Trainer", "pytorch_lightning.trainer.trainer.Trainer"),
            "Lightning Trainer (lightning.pytorch or pytorch_lightning)",
            "spotguard.hook.adapters.lightning_deepspeed:install"),  # it picks: DeepSpeedStrategy or not
    Adapter(("transformers.trainer.Trainer",), "Hugging Face transformers.Trainer",
            "spotguard.hook.adapters.hf:install"),
    Adapter(("accelerate.accelerator.Accelerator",), "accelerate.Accelerator",
            "spotguard.hook.adapters.accelerate:install"),
    Adapter(("ray.train.torch.torch_trainer.TorchTrainer", "ray.train.v2.torch.torch_trainer.TorchTrainer"),
            "Ray Train (install the hook inside train_loop_per_worker with a dict)",
            "spotguard.hook.adapters.ray:install"),
    Adapter(("deepspeed.runtime.engine.DeepSpeedEngine",), "DeepSpeed DeepSpeedEngine (ZeRO 0-3)",
            "spotguard.hook.adapters.deepspeed:install"),
]


def register(adapter: Adapter) -> None:
    """Add (or replace, by first type name) an adapter; later issues plug frameworks in here."""
    for i, a in enumerate(_REGISTRY):
        if set(a.type_names) & set(adapter.type_names):
            _REGISTRY[i] = adapter
            return
    _REGISTRY.append(adapter)


def find(obj: Any) -> Optional[Adapter]:
    """The adapter for ``obj``'s type or any base class, matched by qualified name."""
    for cls in type(obj).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        for a in _REGISTRY:
            if name in a.type_names:
                return a
    return None


def supported() -> list[str]:
    return ["a dict of stateful objects (plain PyTorch)"] + [
        a.description + ("" if a.target else " (not yet)") for a in _REGISTRY
    ]
