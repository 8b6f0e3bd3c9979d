"""Ray Train (``TorchTrainer``): the plain-PyTorch hook inside ``train_loop_per_worker``, reported to Ray.

Ray Train runs ``train_loop_per_worker`` on every worker with
``torch.distributed`` already initialised (gloo on CPU, NCCL on GPU). Inside it
the plain hook works unchanged::

    def train_loop_per_worker(config):
        model = ray.train.torch.prepare_model(net)
        hook = install_preemption_hook({"model": model, "optimizer": opt, ...}, storage=config["storage"])
        start = hook.resume()
        ...

What this module adds: after each commit, every worker calls
``ray.train.report`` (Ray requires all workers to call it the same number of
times) and rank 0 attaches a *pointer checkpoint* — a tiny folder holding
``spotguard.json`` {"uri", "step", "storage"}, the form Ray's docs recommend
for checkpoints that live in your own storage — so Ray's run history and
``ray.train.get_checkpoint()`` name the committed checkpoint without a second
upload of the shards. The hook then raises ``Preempted``; Ray catches it as a
worker failure and ``FailureConfig(max_failures=N)`` restarts the worker group,
whose ``hook.resume()`` loads the newest *committed* checkpoint from spotguard
storage (the pointer and the storage agree by construction).

Ray runs the training function in a worker *thread*, where Python cannot
install signal handlers: notices reach Ray workers through the spotguard
daemon's socket (the normal path on spot VMs) or ``hook.notify(...)``, not
through SIGTERM/SIGUSR1 to the worker.

Passing the ``TorchTrainer`` itself to ``install_preemption_hook`` is a
``TypeError`` that says the above.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

__all__ = ["install", "report_commit", "POINTER_NAME", "pointer_from_checkpoint"]

POINTER_NAME = "spotguard.json"


def install(trainer: Any, storage: Any = None, **_: Any) -> Any:
    raise TypeError(
        "install_preemption_hook(TorchTrainer) is not how Ray Train is hooked: call "
        "install_preemption_hook({'model': model, 'optimizer': opt, ...}, storage=...) inside "
        "train_loop_per_worker (every worker), then start = hook.resume(); committed checkpoints are "
        "reported to Ray automatically and FailureConfig restarts resume from them. See examples/ray_train.py."
    )


def _in_ray_train_worker() -> bool:
    train = sys.modules.get("ray.train")
    if train is None:
        return False
    try:
        train.get_context().get_world_rank()
        return True
    except Exception:  # noqa: BLE001 - outside a Ray Train worker
        return False


def report_commit(hook: Any, step: int, uri: str) -> None:
    """Every worker, right after a commit: ``ray.train.report`` with rank 0's pointer checkpoint. Never raises."""
    if not _in_ray_train_worker():
        return
    import ray.train  # noqa: PLC0415

    tmp = None
    try:
        ckpt = None
        if ray.train.get_context().get_world_rank() == 0:
            tmp = tempfile.mkdtemp(prefix="spotguard-ray-pointer-")
            with open(os.path.join(tmp, POINTER_NAME), "w", encoding="utf-8") as f:
                json.dump({"uri": uri, "step": step, "storage": hook.storage.uri}, f)
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"spotguard_step": step, "spotguard_uri": uri}, checkpoint=ckpt)
        hook._log.info("reported to ray", step=step, uri=uri)
    except Exception as exc:  # noqa: BLE001 - the commit stands; Ray bookkeeping is best effort
        hook._log.warning("ray.train.report failed", error=repr(exc), step=step)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def pointer_from_checkpoint(checkpoint: Any) -> dict[str, Any] | None:
    """The ``{"uri", "step", "storage"}`` of a Ray checkpoint reported by spotguard (``ray.train.get_checkpoint()``)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER_NAME)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
