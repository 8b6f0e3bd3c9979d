"""capture_rng's numpy shortcut: a capture reused only while no draw moved np.random's global state.

The hook captures the RNG after every optimizer step; np.random.get_state() was a third of that cost, so a
capture is reused when the generator's raw bytes are unchanged. Each case here would restore the wrong
stream if the shortcut reused a capture it must not.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from spotguard.hook import state
from spotguard.hook.state import capture_rng, restore_rng


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "_NUMPY_RNG", state._NumpyGlobalRng())
    np.random.seed(1234)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]


def _next_draws(st: dict) -> np.ndarray:
    restore_rng(st)
    return np.random.rand(5)


def test_reused_only_while_unmoved() -> None:
    first = capture_rng()["numpy"]
    assert capture_rng()["numpy"] is first  # nothing drew: the same capture (the shortcut is in use)
    np.random.rand(1)
    moved = capture_rng()["numpy"]
    assert moved is not first and _same(moved, np.random.get_state())


@pytest.mark.parametrize("draw", [lambda: np.random.rand(1), lambda: np.random.randint(0, 10, 700),
                                  lambda: np.random.randn(3), lambda: np.random.shuffle(list(range(9))),
                                  lambda: np.random.seed(7), lambda: np.random.set_state(np.random.get_state())])
def test_every_capture_restores_the_stream_it_was_taken_at(draw) -> None:
    for _ in range(6):
        st = capture_rng()
        expect = np.random.get_state()
        assert _same(st["numpy"], expect)
        want = np.random.rand(5)
        np.random.set_state(expect)
        assert (_next_draws(st) == want).all()
        np.random.set_state(expect)
        draw()


def test_a_pending_gaussian_is_never_reused() -> None:
    np.random.randn(1)  # Box-Muller makes two: one is cached (has_gauss=1), the key moved
    with_cache = capture_rng()["numpy"]
    assert with_cache[3] == 1
    np.random.randn(1)  # hands out the cached one: the key did not move, has_gauss did
    after = capture_rng()["numpy"]
    assert after[3] == 0 and _same(after, np.random.get_state())


def test_a_draw_from_another_thread_between_read_and_get_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw bytes are read before get_state: a draw in between makes the next capture a full one."""
    real = state._NumpyGlobalRng._read_raw
    fired = threading.Event()

    def racing_read(self, np_mod):
        raw = real(self, np_mod)
        if not fired.is_set():
            fired.set()
            t = threading.Thread(target=np.random.rand, args=(2,))
            t.start()
            t.join()
        return raw

    monkeypatch.setattr(state._NumpyGlobalRng, "_read_raw", racing_read)
    raced = capture_rng()["numpy"]
    assert fired.is_set() and _same(raced, np.random.get_state())
    np.random.rand(1)
    assert _same(capture_rng()["numpy"], np.random.get_state())
    assert _same(capture_rng()["numpy"], np.random.get_state())


def test_unknown_layout_turns_the_shortcut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = state._NUMPY_RNG
    monkeypatch.setattr(state._NumpyGlobalRng, "_RAW", 2000)  # bytes that never match get_state
    first = capture_rng()["numpy"]
    assert not cache._usable
    again = capture_rng()["numpy"]
    assert again is not first and _same(again, np.random.get_state())


@pytest.mark.parametrize("value", [{"pos": 3, "epoch": 1, "name": "a", "f": 0.5, "none": None},
                                   [1, 2.0, "x"], (0.9, 0.999), 3, {"nested": {"pos": 1}}, {"t": 1.0, "l": [1]}])
def test_copy_state_is_a_deep_copy(value) -> None:
    import copy

    got = state.copy_state(value)
    assert got == value
    if isinstance(value, (dict, list)):
        assert got is not value
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (dict, list)):
                    assert got[k] is not v  # nested containers are copied too (deepcopy's path)
    assert got == copy.deepcopy(value)


def test_a_state_loaded_with_a_pending_gaussian_and_the_same_key_is_not_the_old_capture() -> None:
    """Review: set_state of a state whose key/position equal the last capture's but with a cached Gaussian
    pending (has_gauss 1) returned the older capture (has_gauss 0): the next randn() differed."""
    np.random.randn()
    saved = np.random.get_state()
    assert saved[3] == 1
    np.random.randn()  # consumes the cached one: same key, has_gauss 0
    assert capture_rng()["numpy"][3] == 0
    np.random.set_state(saved)
    got = capture_rng()["numpy"]
    assert _same(got, saved)
    want = np.random.randn()
    restore_rng({"numpy": got})
    assert np.random.randn() == want


def test_the_hooks_rewind_keeps_the_pending_gaussian_of_step_s() -> None:
    """The hook's own path (Lightning's rewind: rng_and_buffers_at, then a capture for the checkpoint) with a loop
    that draws an odd number of np.random.normal() per step."""
    np.random.normal()
    at_rng = capture_rng()  # step S: a Gaussian pending
    want = np.random.normal()
    np.random.set_state(at_rng["numpy"])
    np.random.normal()  # step S+1 consumes it
    with state.rng_and_buffers_at(at_rng, {}, {}):
        ckpt = capture_rng()
    restore_rng(ckpt)
    assert ckpt["numpy"][3] == 1 and np.random.normal() == want


def test_the_cached_gaussian_value_is_part_of_the_state() -> None:
    st = np.random.get_state()
    capture_rng()
    np.random.set_state((st[0], st[1], st[2], 0, 0.7))  # no pending Gaussian, but another stored value
    assert _same(capture_rng()["numpy"], np.random.get_state())


def test_a_capture_returned_twice_cannot_be_written_into() -> None:
    a = capture_rng()["numpy"]
    b = capture_rng()["numpy"]
    assert a is b
    with pytest.raises(ValueError):
        a[1][0] ^= 1
    np.random.set_state(a)  # numpy and torch.save take the read-only key
    import io

    import torch

    buf = io.BytesIO()
    torch.save(a, buf)
    assert state._NUMPY_RNG._usable


def test_the_shortcut_is_on_with_this_numpy() -> None:
    """If numpy's layout changed under us the shortcut turns itself off (safe): this says so loudly."""
    capture_rng()
    capture_rng()
    assert state._NUMPY_RNG._usable and state._NUMPY_RNG._aug is not None
