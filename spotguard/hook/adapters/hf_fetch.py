"""The HF Trainer: a Dataset or collator that draws from the global RNG in the main process, replayed exactly on a
mid-epoch resume (both paths).

Why: accelerate's ``DataLoaderShard`` fetches one batch ahead. Batch ``m`` (the first of step S+1) was fetched,
and its random augmentation drawn, during the Trainer's ``get_batch_samples`` of step S — from the RNG as it was
there; step S+1's own ``get_batch_samples`` then fetched ``m+1`` (and the rest of its micro-batches) from the RNG
at its start. The resumed Trainer fetches ``m`` and ``m+1`` back to back from a fresh RNG and only then loads
``rng_state``: both batches got other noise than the uninterrupted run's (restoring the RNG before that first
fetch alone is not enough: the dropout of step S ran between the two fetches).

What is kept: in a process whose loader fetches in the main process (``dataloader_num_workers=0``), every
training fetch (the dataset's ``__getitems__``, which the DataLoader calls with a batch's indices, then its
collator) is wrapped: the RNG (python, numpy, torch) before the last fetch and at the start of each
``get_batch_samples`` (wrapped on the Trainer instance) are kept. A checkpoint of S in the middle of an epoch gets
``spotguard_fetch_rng_<rank>.pt``: ``m``'s indices, the RNG before its fetch, and the RNG at the start of step S+1's
``get_batch_samples``. The resumed run sets the latter at the start of its first ``get_batch_samples``, the former
right before the fetch of ``m`` (its indices checked: another order is not replayed, ``data_rng_replayed`` says so
at warning level), then the latter again once ``m``'s collator has drawn too (at the next fetch, or the window's
end), so that ``m+1``... are drawn as the uninterrupted run drew them; the RNG after that call is set back at the step's first callback (the Trainer's ``_load_rng_state`` in
between loads the state of the boundary path's save, taken before those fetches). Costs: one RNG capture a fetch.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

from ...storage.safeload import safe_torch_load
from .. import events as ev
from ..state import capture_rng, pack, restore_rng

__all__ = ["FETCH_RNG", "FetchRng"]

#: ``<this>_<rank>.pt``: the RNG of the resumed run's first fetches (module docstring)
FETCH_RNG = "spotguard_fetch_rng"


class FetchRng:
    """Records the RNG around the Trainer's training fetches; writes and replays it (module docstring)."""

    def __init__(self, trainer: Any, log: Callable[[], Any]) -> None:
        self.trainer, self._logger = trainer, log  # the hook's logger exists once it is armed
        self._on = False  # installed on this run's training dataset
        self._in_window = False  # inside get_batch_samples: the fetches are the training loader's
        self._last: Optional[tuple[list[int], dict[str, Any]]] = None  # (indices, RNG before) of the last fetch
        self._carry: Optional[tuple[list[int], dict[str, Any]]] = None  # ... as at the current window's start
        self._window: Optional[dict[str, Any]] = None  # the RNG at the current get_batch_samples' start
        self._replay: Optional[dict[str, Any]] = None  # loaded from the resumed folder, until its first window
        self._after: Optional[dict[str, Any]] = None  # the RNG after the replayed window, set at on_step_begin
        self._per_epoch = 0  # the Trainer's optimizer steps an epoch
        orig = trainer.get_batch_samples
        trainer.get_batch_samples = lambda *a, **kw: self._batch_samples(orig, *a, **kw)

    # ------------------------------------------------------------------ the training thread

    def install(self, loader: Any) -> None:
        """``on_train_begin``: wrap the training dataset's fetch (main-process loading only: a worker would have
        to pickle the wrapper, and its draws are the worker's own RNG)."""
        ds = getattr(loader, "dataset", None)
        if self._on or ds is None or int(getattr(loader, "num_workers", 0) or 0) != 0:
            return
        accum = max(1, int(getattr(self.trainer.args, "gradient_accumulation_steps", 1) or 1))
        try:
            self._per_epoch = math.ceil(len(loader) / accum)
        except TypeError:  # no length (an iterable dataset): the Trainer does not skip by position
            return
        own = getattr(type(ds), "__getitems__", None)

        def getitems(indices: Any) -> Any:
            if self._in_window:
                self._before_fetch(list(indices))
            return own(ds, indices) if own is not None else [ds[i] for i in indices]

        try:
            ds.__getitems__ = getitems
        except (AttributeError, TypeError):  # __slots__ / a frozen object: nothing kept, nothing replayed
            return
        self._on = True

    def _batch_samples(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        if self._replay is not None:
            restore_rng(self._replay["window"])  # the RNG at the end of S, as the uninterrupted run had it here
        self._carry, self._window, self._in_window = self._last, capture_rng(), True
        try:
            return orig(*args, **kwargs)
        finally:
            self._in_window = False
            if self._replay is not None and self._replay.get("_fetched"):  # m, then no other fetch (its epoch's last)
                self._window_again()
            if self._replay is not None:  # m was not fetched here (another order, or resumed at an epoch start)
                self._logger().warning(ev.DATA_RNG_REPLAYED, replayed=False,
                                  why="the resumed run's first fetch was not the batch the checkpoint's step "
                                      "fetched ahead: its random augmentation may differ from the uninterrupted "
                                      "run's")
                self._replay = None
            elif self._after is not None:
                self._after = capture_rng()

    def _window_again(self) -> None:
        """After the replayed fetch of ``m`` and its collator: the RNG at S+1's window start again, as the
        uninterrupted run had it at the fetch of ``m+1`` (set not before the collator of ``m`` has drawn)."""
        assert self._replay is not None
        restore_rng(self._replay["window"])
        self._replay = None

    def _before_fetch(self, indices: list[int]) -> None:
        rep = self._replay
        if rep is not None and rep.get("_fetched"):  # m+1 ... as the uninterrupted run's step S+1 drew them
            self._window_again()
        elif rep is not None:
            if indices == rep["indices"]:
                restore_rng(rep["fetch"])
                rep["_fetched"] = True
                self._last = (indices, rep["fetch"])
                self._after = {}  # taken once this window ends
                self._logger().info(ev.DATA_RNG_REPLAYED, replayed=True, step=int(self.trainer.state.global_step))
                return
            # not m: not replayed (_batch_samples says so); recorded as any fetch
        self._last = (indices, capture_rng())

    def step_begin(self) -> None:
        """First of ``on_step_begin``'s callbacks: the RNG after the replayed window (the Trainer loaded another)."""
        after, self._after = self._after, None
        if after:
            restore_rng(after)

    # ------------------------------------------------------------------ checkpoint and resume

    def at_window(self) -> Optional[dict[str, Any]]:
        """For a checkpoint of the step whose successor's ``get_batch_samples`` has run (``on_step_begin``)."""
        if not self._on or self._carry is None or self._window is None:
            return None
        return {"indices": self._carry[0], "fetch": self._carry[1], "window": self._window}

    def at_boundary(self) -> Optional[dict[str, Any]]:
        """For a checkpoint of the step that has just ended (``on_step_end``; the next fetches still to come)."""
        if not self._on or self._last is None:
            return None
        return {"indices": self._last[0], "fetch": self._last[1], "window": capture_rng()}

    def write(self, folder: str, rank: int, step: int, data: Optional[dict[str, Any]]) -> None:
        """This rank's file of a checkpoint of ``step``, when the resumed Trainer will skip into its epoch."""
        if data is not None and self._mid_epoch(step):
            with open(os.path.join(folder, f"{FETCH_RNG}_{rank}.pt"), "wb") as f:
                f.write(pack(data))

    def load(self, folder: Optional[str], rank: int, step: int) -> None:
        """``on_train_begin`` of a resumed run: the replay of the resumed folder's file (mid-epoch only)."""
        path = os.path.join(folder, f"{FETCH_RNG}_{rank}.pt") if folder else ""
        if not (self._on and path and os.path.isfile(path) and self._mid_epoch(step)):
            return
        with open(path, "rb") as f:
            self._replay = dict(safe_torch_load(f.read(), path))
        # a checkpoint of the resumed step itself (a notice before its successor's first step) holds the same
        self._last = (list(self._replay["indices"]), self._replay["fetch"])

    def _mid_epoch(self, step: int) -> bool:
        """Whether the Trainer resumed at ``step`` skips batches of its epoch (its own rule, ``_run_epoch``)."""
        return self._per_epoch > 0 and step % self._per_epoch != 0 and \
            not getattr(self.trainer.args, "ignore_data_skip", False)
