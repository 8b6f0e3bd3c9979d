"""``StepCopies`` and the watch's excused parameters (issue 23: several optimizers, a notice after D's step).

In-process: what a state dict read for boundary S holds once D has stepped (its copies of S, G live), that the
buffers are allocated once, the byte bound, and that ``StateWatch`` ignores writes (``_version`` and
``Parameter.data``) only to the parameters a copy holds.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from spotguard.hook.stepcopy import StepCopies
from spotguard.hook.watch import StateWatch


def _gan() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    return d, g, torch.optim.Adam(d.parameters(), lr=0.1), torch.optim.Adam(g.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()


def _state(d: torch.nn.Module, g: torch.nn.Module, od: torch.optim.Optimizer, og: torch.optim.Optimizer) -> dict:
    return {"d": get_model_state_dict(d), "g": get_model_state_dict(g), "opt_d": get_optimizer_state_dict(d, od),
            "opt_g": get_optimizer_state_dict(g, og)}


def _clone(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_substitute_gives_the_boundary_state_after_d_stepped() -> None:
    d, g, od, og = _gan()
    _step(d, od)
    _step(g, og)  # boundary S = 1: both optimizers have state
    at_s = _clone(_state(d, g, od, og))
    copies = StepCopies(max_bytes=1 << 20)
    copies.reset(1)
    assert copies.before_first_step("opt_d", od, "d", d) is None
    bufs = [t for t in copies._bufs.values()]
    _step(d, od)  # D moves on; G not yet
    live = _state(d, g, od, og)
    assert not _equal(live["d"], at_s["d"]) and not _equal(live["opt_d"]["state"], at_s["opt_d"]["state"])
    got = copies.substitute(live, 1)
    assert _equal(got, at_s)
    assert _equal(copies.substitute(live, 2), live)  # another boundary's read: untouched
    assert not _equal(live["d"], at_s["d"])  # the live dicts were not written
    # the next iteration reuses the same buffers
    _step(g, og)
    copies.reset(2)
    assert not copies.active(2)
    assert copies.before_first_step("opt_d", od, "d", d) is None
    assert all(any(b is t for t in copies._bufs.values()) for b in bufs)


def test_tied_weights_are_substituted_under_every_name() -> None:
    torch.manual_seed(0)
    d = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    d[1].weight = d[0].weight  # tied: the state dict names it twice, named_parameters() once
    od = torch.optim.Adam(d.parameters(), lr=0.1)
    _step(d, od)
    at_s = _clone({"d": get_model_state_dict(d), "opt_d": get_optimizer_state_dict(d, od)})
    assert len(at_s["d"]) == 2
    copies = StepCopies(max_bytes=1 << 20)
    copies.reset(1)
    assert copies.before_first_step("opt_d", od, "d", d) is None
    _step(d, od)
    got = copies.substitute({"d": get_model_state_dict(d), "opt_d": get_optimizer_state_dict(d, od)}, 1)
    assert _equal(got, at_s)


def test_state_created_by_the_first_step_is_left_out_and_the_bound_is_kept() -> None:
    d, g, od, og = _gan()
    copies = StepCopies(max_bytes=1 << 20)
    copies.reset(0)
    assert copies.before_first_step("opt_d", od, "d", d) is None  # no Adam state yet at the boundary
    _step(d, od)
    got = copies.substitute(_state(d, g, od, og), 0)
    assert got["opt_d"]["state"] == {}
    small = StepCopies(max_bytes=8)
    small.reset(0)
    why = small.before_first_step("opt_d", od, "d", d)
    assert why is not None and "SPOTGUARD_STEP_COPY_MAX_BYTES" in why and not small.active(0)
    assert "not its model's" in (StepCopies().before_first_step("opt_g", og, "d", d) or "")


def test_watch_excuses_only_the_copied_parameters() -> None:
    d, g, od, og = _gan()
    watch = StateWatch({"d": d, "g": g}, {})
    try:
        watch.mark()
        assert watch.untouched(list(d.parameters()))
        for p in d.parameters():
            p.data.clamp_(-0.01, 0.01)  # WGAN's clipping: through .data, no _version bump
        assert not watch.untouched(list(d.parameters())) and watch.untouched(list(g.parameters()))
        assert watch.changed() is not None
        watch.excuse(list(d.parameters()))
        _step(d, od)
        assert watch.changed() is None  # D's own writes are what the copies stand in for
        g.weight.data.mul_(1.0)  # a .data access to a parameter no copy holds
        assert watch.changed() == "Parameter.data was used outside optimizer.step()"
        watch.mark()
        assert watch.skip == frozenset() and watch.changed() is None
        _step(d, od)
        assert watch.changed() == "a parameter was written outside optimizer.step()"  # excused no more
    finally:
        watch.close()


def test_a_module_shared_by_two_models_is_substituted_in_both() -> None:
    """A conditional GAN's class embedding registered in G and in D (both optimizers step it): once D has
    stepped, G's model state dict names the same parameter and must hold its copy too (review ganrev: G's
    entry held D's post-step value, and the resume loads whichever model comes last)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(3, 4)
    d, g = torch.nn.Sequential(emb, torch.nn.Linear(4, 1)), torch.nn.Sequential(emb, torch.nn.Linear(4, 4))
    od, og = torch.optim.Adam(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1, momentum=0.9)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(torch.tensor([0, 2])).square().sum().backward()
        opt.step()

    step(d, od)
    step(g, og)  # boundary S = 1
    at_s = _clone(_state(d, g, od, og))
    copies = StepCopies(max_bytes=1 << 20)
    copies.reset(1)
    assert copies.before_first_step("opt_d", od, "d", d) is None
    step(d, od)  # D moves the shared embedding; G has not stepped
    got = copies.substitute(_state(d, g, od, og), 1)
    assert torch.equal(got["g"]["0.weight"], at_s["g"]["0.weight"])
    assert _equal(got, at_s)


def test_a_parameter_a_copied_optimizer_moved_is_not_copied_again() -> None:
    """Three optimizers, A's and B's sharing a parameter (review ganrev): once A has stepped it, B's copy would
    take A's post-step value as the boundary's, so ``untouched`` refuses B (its step then marks "inside the
    iteration": a round stands at the iteration's end)."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    a, b = torch.nn.Sequential(shared, torch.nn.Linear(4, 1)), torch.nn.Sequential(shared, torch.nn.Linear(4, 2))
    oa = torch.optim.Adam(a.parameters(), lr=0.1)
    watch = StateWatch({"a": a, "b": b}, {})
    try:
        watch.mark()
        assert watch.untouched(list(a.parameters())) and watch.untouched(list(b.parameters()))
        watch.excuse(list(a.parameters()))
        _step(a, oa)
        assert watch.changed() is None  # A's writes are what its copies stand in for
        assert not watch.untouched(list(b.parameters()))  # the shared layer moved: no copy of it for B
        assert watch.untouched(list(b[1].parameters()))
    finally:
        watch.close()
