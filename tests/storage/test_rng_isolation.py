"""Regression (found by the chaos run): storage retries must not draw from the global RNGs.

A periodic checkpoint uploads in a background thread while the job trains; the retry jitter
used ``random.uniform`` of the global ``random`` module, so a throttled upload changed the
training's Python random stream and the run diverged from an uninterrupted one (chaos run
seed 2026, cycle 2: notice during a periodic upload with 503 SlowDown, first different loss
one step after the staging).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .conftest import Store


class TestS3Retries:
    kind = "s3"

    def test_throttled_upload_leaves_global_rngs_untouched(self, store: Store) -> None:
        s = store.open()
        store.slowdown(4, method="PUT")
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        before = (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state())
        s.write_bytes("x/blob", b"data" * 100)
        assert store.proxy.injected >= 4 and s.retries >= 4
        after = (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state())
        assert before[0] == after[0], "the global python RNG moved"
        assert before[1] == after[1] and torch.equal(before[2], after[2])
