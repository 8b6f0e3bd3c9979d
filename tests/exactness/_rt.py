"""In-process side of the exactness oracle: phases, the notice thread, and the whole-state digest.

A pattern script (``tests/exactness/patterns/*.py``) is an ordinary training script that also calls
``rt.phase(name)`` where its loop enters a phase, ``rt.resumed(start, state)`` right after
``hook.resume()`` and ``rt.end_iteration(i, state)`` at the end of each iteration. Why a module
rather than flags: the oracle (``oracle.py``) drives every pattern through the same environment
variables, so a pattern stays a short script that reads like user code.

Environment (set by ``oracle.py``):

- ``EXO_OUT``: this rank's JSON-lines record (``{out}.rank{r}.jsonl``), one line per event, flushed
  at once (a process can leave through ``os._exit``).
- ``EXO_STORAGE``: the hook's storage URI.
- ``EXO_NOTICE``: ``at:SECONDS`` (uniformly random moment: that long after the loop started) or
  ``phase:NAME@ITER`` (when the loop enters phase NAME of iteration ITER); empty = no notice.
- ``EXO_NOTICE_RANK``: the one rank that gets the notice (a daemon drill reaches one node).
- ``EXO_NOTICE_SOURCE`` (``signal``/``drill``), ``EXO_NOTICE_KIND`` (``termination``, or ``rebalance``/
  ``maintenance``: an ordinary notice, the run must go on), ``EXO_NOTICE_DEADLINE`` (seconds from the notice).
- ``EXO_EVERY``, ``EXO_KEEP``: the hook's ``every=`` (seconds) and ``keep=`` for patterns that pass
  ``every()``/``keep()``; ``EXO_SLOW_PERIODIC``: seconds each periodic (``every=``) upload takes (``store()``),
  so that a notice can land while one is in flight (background phases ``periodic``: before its first byte,
  ``periodic_mid``: half of it written).
- ``EXO_FAST_WITHOUT_NOTICE=1``: with no ``EXO_NOTICE``, the phases take no time (``phase``).

The digest never draws from an RNG and never runs module state-dict hooks (parameters and buffers
are read through ``named_parameters``/``named_buffers``; a DTensor is digested as its local shard),
so recording it does not change the run it records.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import threading
import time
from typing import Any, Mapping

import numpy as np
import torch

PHASE = "setup"          # the phase the training thread is in now (read by the notice thread)
ITER = -1                # the iteration in progress (0-based)
_SLEEPS: dict[str, float] = {}
_OUT: Any = None
_LOCK = threading.Lock()
_HOOK: Any = None
_FIRED = threading.Event()
_TARGET: tuple[str, int] | None = None

# How long each phase lasts (seconds): wide enough that a random moment lands in each of them.
DEFAULT_SLEEPS = {
    "load": 0.04, "fwd": 0.04, "bwd": 0.04, "prestep": 0.03, "step": 0.03, "after": 0.03,
    "eval": 0.08, "micro": 0.03, "first": 0.04, "second": 0.04, "d_step": 0.03, "g_step": 0.03,
    "critic_load": 0.04,
}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def storage() -> str:
    return os.environ["EXO_STORAGE"]


def _write(rec: dict[str, Any]) -> None:
    global _OUT
    with _LOCK:
        if _OUT is None:
            path = os.environ.get("EXO_OUT")
            if not path:
                return
            _OUT = open(f"{path}.rank{rank()}.jsonl", "a", buffering=1)
        _OUT.write(json.dumps(rec) + "\n")
        _OUT.flush()


# ---------------------------------------------------------------- digest

def _feed(h: Any, obj: Any) -> None:
    """A canonical, typed encoding of ``obj`` into the hash ``h`` (dicts sorted by key)."""
    if isinstance(obj, torch.Tensor):
        t = obj
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        t = t.detach().cpu().contiguous()
        h.update(b"T" + str(t.dtype).encode() + repr(tuple(t.shape)).encode())
        if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(b"N" + str(obj.dtype).encode() + repr(obj.shape).encode() + obj.tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"D%d" % len(obj))
        for k in sorted(obj, key=lambda x: (type(x).__name__, str(x))):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(b"L%d" % len(obj))
        for v in obj:
            _feed(h, v)
    elif isinstance(obj, bool) or obj is None:
        h.update(b"B" + repr(obj).encode())
    elif isinstance(obj, int):
        h.update(b"I" + str(obj).encode())
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, (str, bytes)):
        h.update(b"S" + (obj.encode() if isinstance(obj, str) else obj))
    elif isinstance(obj, (np.integer, np.floating)):
        _feed(h, obj.item())
    else:
        h.update(b"R" + repr(obj).encode())


def _hex(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()[:16]


def module_state(m: torch.nn.Module) -> dict[str, Any]:
    """Parameters and buffers by name, read without state-dict hooks (FSDP2's reshard)."""
    inner = getattr(m, "module", m)  # DDP / AveragedModel keep the user's module under .module
    out: dict[str, Any] = {}
    for n, p in inner.named_parameters():
        out["p:" + n] = p
    for n, b in inner.named_buffers():
        out["b:" + n] = b
    if inner is not m:
        for n, b in m.named_buffers(recurse=False):  # AveragedModel.n_averaged
            out["b:" + n] = b
    return out


def _value(obj: Any) -> Any:
    """What of an item the digest covers."""
    if isinstance(obj, torch.nn.Module):
        return module_state(obj)
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    if callable(obj):
        return obj()
    return obj


def rng_state() -> dict[str, Any]:
    return {"rng.python": random.getstate(), "rng.numpy": np.random.get_state(), "rng.torch": torch.get_rng_state()}


def digest(state: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(item -> hash, item -> {first-level key -> hash}): the whole training state, per item."""
    values: dict[str, Any] = {k: _value(v) for k, v in state.items()}
    values.update(rng_state())
    items: dict[str, str] = {}
    sub: dict[str, dict[str, str]] = {}
    for k, v in values.items():
        items[k] = _hex(v)
        if isinstance(v, Mapping):
            sub[k] = {str(kk): _hex(vv) for kk, vv in v.items()}
    return items, sub


# ---------------------------------------------------------------- the loop's calls

def phase(name: str, *, sleep: bool = True) -> None:
    """The training thread enters phase ``name`` (and stays there a while, so notices can land in it)."""
    global PHASE
    PHASE = name
    if _TARGET is not None and not _FIRED.is_set() and _TARGET == (name, ITER):
        threading.Thread(target=_fire, name="exo-notice", daemon=True).start()
        _FIRED.wait(10)  # the notice is handed over while the loop is in this phase
    if sleep and not _fast():
        time.sleep(_SLEEPS.get(name, DEFAULT_SLEEPS.get(name, 0.03)))


def _fast() -> bool:
    """``EXO_FAST_WITHOUT_NOTICE=1`` (the short version) and no notice: a reference or a resume, whose phases
    need no length (they are long so that a notice lands in each; the long version draws its random moments
    over the reference loop's length, so it leaves them on). Read at each call: the zygote imported this early."""
    return os.environ.get("EXO_FAST_WITHOUT_NOTICE", "") == "1" and not os.environ.get("EXO_NOTICE", "")


def background_phase(name: str) -> None:
    """A moment of a background thread (a periodic save's upload): ``phase:NAME@ITER`` fires at the first such
    moment while the training thread is at iteration ITER or later. Never changes the training thread's phase."""
    if _TARGET is not None and not _FIRED.is_set() and _TARGET[0] == name and ITER >= _TARGET[1]:
        threading.Thread(target=_fire, args=(name,), name="exo-notice", daemon=True).start()
        _FIRED.wait(10)


def every() -> float | None:
    v = os.environ.get("EXO_EVERY", "")
    return float(v) if v else None


def keep() -> int | None:
    v = os.environ.get("EXO_KEEP", "")
    return int(v) if v else None


def store() -> Any:
    """The hook's storage: the URI, or with ``EXO_SLOW_PERIODIC=SECONDS`` the same local store whose periodic
    (``every=``) uploads take that long, spread over their write items (a slow link: the upload's own
    throughput estimate stays meaningful). Emergency and ordinary saves are not slowed."""
    delay = float(os.environ.get("EXO_SLOW_PERIODIC", "0") or 0)
    if delay <= 0:
        return storage()
    from spotguard.storage import open_storage  # noqa: PLC0415

    st = open_storage(storage())
    make_writer = st.dcp_writer

    def dcp_writer(key: str, *, thread_count: int | None = None) -> Any:
        w = make_writer(key, thread_count=thread_count)
        if threading.current_thread().name != "spotguard-periodic":
            return w
        write = w.write_data

        def write_data(plan: Any, planner: Any) -> Any:
            items = max(1, len(plan.items))
            resolve = planner.resolve_data
            done = [0]

            def slow(item: Any) -> Any:
                if done[0] == 0:
                    background_phase("periodic")
                elif done[0] == items // 2:
                    background_phase("periodic_mid")
                done[0] += 1
                time.sleep(delay / items)
                return resolve(item)

            planner.resolve_data = slow
            return write(plan, planner)

        w.write_data = write_data
        return w

    st.dcp_writer = dcp_writer
    return st


def inside_step(opt: torch.optim.Optimizer) -> None:
    """A phase inside ``optimizer.step()`` (a pre-hook registered after spotguard's)."""
    def pre(*_: Any) -> None:
        phase("step")
    opt.register_step_pre_hook(pre)


def _fire(label: str | None = None) -> None:
    from datetime import timedelta  # noqa: PLC0415

    from spotguard.notice import Notice  # noqa: PLC0415
    from spotguard.timefmt import utcnow  # noqa: PLC0415

    rng = random.Random(os.environ.get("EXO_SEED", "0"))  # never the global RNG: it is training state
    now = utcnow()
    source = os.environ.get("EXO_NOTICE_SOURCE", "drill")
    kind = os.environ.get("EXO_NOTICE_KIND", "termination")
    deadline = float(os.environ.get("EXO_NOTICE_DEADLINE", str(rng.uniform(20, 30))))
    nid = f"{source}-exo-{os.getpid()}"
    _write({"kind": "notice", "phase": label or PHASE, "iter": ITER, "t": time.time(), "source": source,
            "notice_kind": kind, "deadline_in": deadline, "id": nid})
    _FIRED.set()
    _HOOK.notify(Notice(id=nid, source=source, kind=kind,
                        deadline=now + timedelta(seconds=deadline), received_at=now))


def resumed(hook: Any, start: int, state: Mapping[str, Any]) -> None:
    """Right after ``hook.resume()``: record the state the run continues from and arm the notice."""
    global _HOOK, _TARGET, ITER
    _HOOK = hook
    ITER = start
    items, sub = digest(state)
    _write({"kind": "resumed", "completed": start, "items": items, "sub": sub, "t": time.time()})
    spec = os.environ.get("EXO_NOTICE", "")
    if spec and int(os.environ.get("EXO_NOTICE_RANK", "0")) == rank():
        how, _, arg = spec.partition(":")
        if how == "at":
            t = threading.Timer(float(arg), _fire)
            t.daemon = True
            t.start()
        elif how == "phase":
            name, _, it = arg.partition("@")
            _TARGET = (name, int(it))


def begin_iteration(i: int) -> None:
    global ITER
    ITER = i


def end_iteration(i: int, state: Mapping[str, Any], **extra: Any) -> None:
    """The end of iteration ``i``: ``i + 1`` iterations completed (``extra``: more of the record, e.g.
    ``opt_steps``, the optimizer steps taken so far, where they differ from iterations)."""
    global PHASE
    PHASE = "end"
    items, sub = digest(state)
    _write({"kind": "iter", "completed": i + 1, "items": items, "sub": sub, "t": time.time(), **extra})


def finished(state: Mapping[str, Any], steps: int) -> None:
    items, sub = digest(state)
    _write({"kind": "final", "completed": steps, "items": items, "sub": sub, "t": time.time()})


def steps() -> int:
    return int(os.environ.get("EXO_STEPS", "10"))

