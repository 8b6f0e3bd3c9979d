"""What each object in the user's state dict is, and how its state is captured.

Classification rule (by type and protocol, never by key name), first match wins:

1. ``torch.nn.Module`` (plain, DDP- or otherwise wrapped) -> **model**: saved through
   ``torch.distributed.checkpoint.state_dict`` so replicated DDP state is written
   once. Buffers of normalisation layers that track running statistics
   (BatchNorm & co.) change during ``forward``, so they are also snapshotted
   after each optimizer step and restored per rank.
2. ``torch.optim.Optimizer`` -> **optimizer**: saved by parameter FQN against the
   model that owns its parameters (that model must be in the dict too).
3. ``torch.optim.lr_scheduler.LRScheduler`` / ``ReduceLROnPlateau`` -> **scheduler**.
4. ``torch.amp.GradScaler`` (and ``torch.cuda.amp.GradScaler``) -> **scaler**; it is
   also the iteration clock, because it skips ``optimizer.step()`` on inf/nan.
5. Anything with ``state_dict``/``load_state_dict`` that is also iterable
   (``__iter__`` or ``__next__``: data loaders, samplers, iterable datasets) ->
   **loader**. Its state advances *before* the next optimizer step (the next
   batch is fetched), so it is taken from the snapshot made right after the
   deciding step, per rank.
6. Anything else with ``state_dict``/``load_state_dict`` -> **stateful** (EMA,
   metrics, counters): read at the boundary like schedulers, saved per rank.

A plain ``torch.utils.data.DataLoader`` (no ``state_dict``) built on a
``spotguard.data.ElasticDistributedSampler`` is accepted as a **loader**: the
hook keeps the sampler (whose state is the global data position) and attaches
the loader to it, so the position counts the batches the training loop took,
not what prefetching workers pulled.

Schedulers, scalers, loaders, stateful objects and RNG states are small and are
saved per rank (rank-unique key), so no rank's copy is ever deduplicated away.

Scope, for a resume on another world size (``spotguard.hook.elastic``): each
object is **global** (equal on every rank: restored on every rank, a new rank
takes rank 0's copy) or **per_rank** (a rank that existed takes its own copy, a
new rank starts from the object as constructed). Defaults: schedulers, scalers
and stateful objects are global; loaders are per_rank; an object whose class has
``spotguard_scope = "global"`` or ``"per_rank"`` says so itself (the elastic
sampler is global); the hook's ``scope={"key": "per_rank"}`` keyword wins over
both. Models and optimizers are resharded by DCP; RNG is per rank (new ranks get
a derived stream, see ``elastic.derive_rng``).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import io
import random
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch

__all__ = [
    "RESERVED_PREFIX",
    "Objects",
    "classify",
    "capture_rng",
    "copy_state",
    "restore_rng",
    "Snapshot",
    "tracked_buffers",
    "pack",
    "clone_buffers",
    "copy_buffers",
    "rng_and_buffers_at",
    "unpack",
    "GLOBAL",
    "PER_RANK",
]

RESERVED_PREFIX = "__spotguard__"
GLOBAL, PER_RANK = "global", "per_rank"
_SCOPED_ROLES = ("schedulers", "scalers", "loaders", "stateful")


@dataclass
class Objects:
    """The user's dict, split by role; dict order is kept (the first optimizer is the clock)."""

    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    scalers: dict[str, Any] = field(default_factory=dict)
    loaders: dict[str, Any] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # optimizer key -> model key
    scope: dict[str, str] = field(default_factory=dict)  # key -> GLOBAL | PER_RANK (non-model objects)

    def roles(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for role in ("models", "optimizers", "schedulers", "scalers", "loaders", "stateful"):
            for key in getattr(self, role):
                out[key] = role.rstrip("s") if role != "stateful" else "stateful"
        return out


def _is_scheduler(obj: Any) -> bool:
    lrs = torch.optim.lr_scheduler
    kinds = tuple(t for t in (getattr(lrs, "LRScheduler", None), getattr(lrs, "_LRScheduler", None),
                              getattr(lrs, "ReduceLROnPlateau", None)) if isinstance(t, type))
    return isinstance(obj, kinds)


def _is_scaler(obj: Any) -> bool:
    kinds: list[type] = []
    amp = getattr(torch, "amp", None)
    if amp is not None and isinstance(getattr(amp, "GradScaler", None), type):
        kinds.append(amp.GradScaler)
    try:
        from torch.cuda.amp import GradScaler as CudaScaler  # noqa: PLC0415

        kinds.append(CudaScaler)
    except Exception:  # pragma: no cover - very old or stripped builds
        pass
    return isinstance(obj, tuple(kinds))


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _params_of(model: torch.nn.Module) -> set[int]:
    return {id(p) for p in model.parameters()}


def _elastic_sampler_of(obj: Any) -> Any:
    """The ``ElasticDistributedSampler`` under a plain (stateless) ``DataLoader``, else None."""
    from torch.utils.data import DataLoader  # noqa: PLC0415

    if not isinstance(obj, DataLoader) or _stateful(obj):
        return None
    from ..data import ElasticDistributedSampler  # noqa: PLC0415

    for cand in (getattr(obj, "sampler", None), getattr(getattr(obj, "batch_sampler", None), "sampler", None)):
        if isinstance(cand, ElasticDistributedSampler):
            return cand
    return None


def _scope_of(key: str, role: str, obj: Any, override: Mapping[str, str]) -> str:
    if key in override:
        return override[key]
    declared = getattr(type(obj), "spotguard_scope", None)
    if declared in (GLOBAL, PER_RANK):
        return str(declared)
    return PER_RANK if role == "loaders" else GLOBAL


def classify(state: Mapping[str, Any], scope: Mapping[str, str] | None = None) -> Objects:
    """Split the user's dict by role and scope (see the module docstring); TypeError names any key it cannot use."""
    if not isinstance(state, Mapping):
        raise TypeError(f"expected a dict of stateful objects, got {type(state).__name__}")
    scope = dict(scope or {})
    for key, value in scope.items():
        if value not in (GLOBAL, PER_RANK):
            raise ValueError(f"scope[{key!r}] must be {GLOBAL!r} or {PER_RANK!r}, got {value!r}")
    objs = Objects()
    for key, obj in state.items():
        sampler = _elastic_sampler_of(obj)
        if sampler is not None:
            sampler.attach(obj)
            obj = sampler
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty strings, got {key!r}")
        if key.startswith(RESERVED_PREFIX) or "." in key:
            raise TypeError(f"state key {key!r} is not allowed (no '.', no {RESERVED_PREFIX!r} prefix)")
        if isinstance(obj, torch.nn.Module):
            objs.models[key] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            objs.optimizers[key] = obj
        elif _is_scheduler(obj):
            objs.schedulers[key] = obj
        elif _is_scaler(obj):
            objs.scalers[key] = obj
        elif _stateful(obj) and (hasattr(obj, "__iter__") or hasattr(obj, "__next__")):
            objs.loaders[key] = obj
        elif _stateful(obj):
            objs.stateful[key] = obj
        else:
            raise TypeError(
                f"state[{key!r}] is a {type(obj).__module__}.{type(obj).__qualname__} without "
                "state_dict()/load_state_dict(): spotguard cannot save or restore it. Pass only "
                "stateful objects (model, optimizer, scheduler, GradScaler, a stateful data loader "
                "such as torchdata's StatefulDataLoader, or your own object with those two methods)."
            )
    for key in scope:
        if key not in state:
            raise ValueError(f"scope names {key!r}, which is not a key of the state dict")
    for role in _SCOPED_ROLES:
        for key, obj in getattr(objs, role).items():
            objs.scope[key] = _scope_of(key, role, obj, scope)
    for key in set(scope) & (set(objs.models) | set(objs.optimizers)):
        raise ValueError(f"scope[{key!r}]: models and optimizers are resharded by DCP and take no scope")
    if len(objs.scalers) > 1:
        raise TypeError(f"at most one GradScaler is supported, got {list(objs.scalers)}")
    params = {k: _params_of(m) for k, m in objs.models.items()}
    for okey, opt in objs.optimizers.items():
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        owners = [mk for mk, ps in params.items() if ids and ids <= ps]
        if not owners:
            raise TypeError(
                f"optimizer {okey!r} updates parameters that belong to no single nn.Module in the dict: "
                "add the model (plain or DDP-wrapped) to the state dict"
            )
        objs.owner[okey] = owners[0]
    return objs


# --- RNG ---------------------------------------------------------------------


class _NumpyGlobalRng:
    """``np.random``'s global (legacy) state, captured in ~1 µs while nothing has moved it.

    Why: ``np.random.get_state()`` costs ~45 µs (numpy copies the 624-word MT19937 key one element at a
    time) and the hook captures the RNG after every optimizer step — a third of its per-step cost. The
    whole legacy state is read raw instead and compared with the last capture's: the generator's key and
    position (2,500 bytes through numpy's own ``ctypes.state_address``) and the ``RandomState``'s cached
    Gaussian (``has_gauss``, ``gauss``: its ``_aug_state``, found once inside the object by the pointer it
    holds to the bit generator's state, within the object's size). Equal means ``get_state()`` would return
    the last capture. A state loaded by ``set_state`` with the same key but a pending Gaussian differs there
    (the reviewer's case: the hook's own rewind restored such a state and got the older capture back). Every
    full capture checks the raw read against ``get_state()``; one disagreement (another numpy layout, another
    bit generator) turns the shortcut off for good. Not while a Gaussian is pending either (conservative).
    """

    _RAW = 624 * 4 + 4  # uint32 key[624]; int pos  (numpy/random/src/mt19937/mt19937.h)
    _P = ctypes.sizeof(ctypes.c_void_p)

    def __init__(self) -> None:
        self._raw: Optional[bytes] = None
        self._state: Any = None
        self._usable = True
        self._aug: Optional[tuple[int, int]] = None  # (id of the RandomState, offset of its _aug_state)

    def _locate_aug(self, rs: Any, state_address: int) -> Optional[int]:
        """Offset of ``aug_bitgen_t {bitgen_t *bit_generator; int has_gauss; double gauss}`` in ``rs``: right
        after its ``bitgen_t _bitgen`` (5 pointers, the first being ``state_address``), and pointing back to it."""
        size, p, base = type(rs).__basicsize__, self._P, id(rs)
        words = (ctypes.c_size_t * (size // p)).from_address(base)
        for k in range(size // p):
            aug = (k + 5) * p
            if words[k] == state_address and aug + 3 * p <= size and words[k + 5] == base + k * p:
                return aug
        return None

    def _read_raw(self, np: Any) -> Optional[bytes]:
        if not self._usable:
            return None
        try:
            rs = np.random.get_state.__self__
            bg = rs._bit_generator
            if type(bg).__name__ != "MT19937":
                return None
            addr = bg.ctypes.state_address
            if self._aug is None or self._aug[0] != id(rs):
                aug = self._locate_aug(rs, addr)
                if aug is None:
                    self._usable = False
                    return None
                self._aug = (id(rs), aug)
            base = id(rs) + self._aug[1]
            return ctypes.string_at(addr, self._RAW) + \
                ctypes.c_int.from_address(base + self._P).value.to_bytes(4, sys.byteorder, signed=True) + \
                ctypes.string_at(base + 2 * self._P, 8)
        except Exception:  # noqa: BLE001 - no such attribute in this numpy: the full path always
            self._usable = False
            return None

    def _agrees(self, raw: bytes, st: Any) -> bool:
        try:
            n = self._RAW
            return bool(st[0] == "MT19937" and raw[: n - 4] == st[1].tobytes()
                        and int.from_bytes(raw[n - 4:n], sys.byteorder, signed=True) == int(st[2])
                        and int.from_bytes(raw[n:n + 4], sys.byteorder, signed=True) == int(st[3])
                        and raw[n + 4:] == struct.pack("=d", float(st[4])))
        except Exception:  # noqa: BLE001
            return False

    def capture(self, np: Any) -> Any:
        raw = self._read_raw(np)  # before get_state: a draw in between only makes the next capture a full one
        if raw is not None and raw == self._raw and self._state is not None and not self._state[3]:
            return self._state
        st = np.random.get_state()
        st[1].setflags(write=False)  # one capture may be returned many times: nobody may write into it
        if raw is not None and not self._agrees(raw, st):
            raw = self._read_raw(np)  # moved by another thread in between, or a layout we do not know
            self._usable = raw is not None and self._agrees(raw, st)
            raw = raw if self._usable else None
        self._raw, self._state = raw, st
        return st


_NUMPY_RNG = _NumpyGlobalRng()


def capture_rng() -> dict[str, Any]:
    """Python, numpy (if imported), torch CPU and CUDA (if initialised) generator states."""
    st: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy"] = _NUMPY_RNG.capture(np)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def restore_rng(st: Mapping[str, Any]) -> None:
    if "python" in st:
        random.setstate(st["python"])
    if "torch" in st:
        torch.set_rng_state(st["torch"])
    if "numpy" in st:
        import numpy as np  # noqa: PLC0415

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        states = st["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:  # device count changed: restore what maps
            for i, s in enumerate(states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


# --- per-iteration snapshot --------------------------------------------------


def tracked_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that ``forward`` mutates: running stats of normalisation layers in training mode."""
    from torch.nn.modules.batchnorm import _NormBase  # noqa: PLC0415

    out: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, _NormBase) and mod.track_running_stats:
            for bname, buf in mod.named_buffers(recurse=False):
                if buf is not None:
                    out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def clone_buffers(buffers: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of tracked buffers by model key and name (models with none left out)."""
    return {mk: {n: b.detach().clone() for n, b in bufs.items()} for mk, bufs in buffers.items() if bufs}


def copy_buffers(live: Mapping[str, Mapping[str, torch.Tensor]],
                 values: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Put ``values`` (a ``clone_buffers`` copy) back into the live buffers, in place (the model keeps its tensors)."""
    with torch.no_grad():
        for mk, bufs in values.items():
            cur = live.get(mk, {})
            for name, val in bufs.items():
                if name in cur:
                    cur[name].copy_(val)


@contextlib.contextmanager
def rng_and_buffers_at(rng: Optional[dict[str, Any]], live: Mapping[str, Mapping[str, torch.Tensor]],
                       values: Mapping[str, Mapping[str, torch.Tensor]]) -> Iterator[None]:
    """This process's RNG (``capture_rng`` form; None: left as is) and the live buffers set to an earlier
    moment's for one save (a framework writes its checkpoint from the live objects); the live values come back
    afterwards, also when the save raises."""
    now_rng = capture_rng()
    now_bufs = clone_buffers(live)
    if rng is not None:
        restore_rng(rng)
    copy_buffers(live, values)
    try:
        yield
    finally:
        copy_buffers(live, now_bufs)
        restore_rng(now_rng)


@dataclass
class Snapshot:
    """State that moves on before the next optimizer step, taken right after the deciding step."""

    rng: dict[str, Any]
    loaders: dict[str, Any]

    @classmethod
    def take(cls, loaders: Mapping[str, Any]) -> "Snapshot":
        """RNG and loader positions now (running-stat buffers are taken at the next forward: stephooks._on_forward)."""
        return cls(rng=capture_rng(), loaders={k: copy_state(v.state_dict()) for k, v in loaders.items()})


_IMMUTABLE = (int, float, bool, str, bytes, type(None))


def copy_state(v: Any) -> Any:
    """``copy.deepcopy(v)``, without its cost where ``v`` is a dict/list/tuple of plain numbers and strings
    (a loader's position, a param group, a meter): copied after every optimizer step, deepcopy of such small
    state was ~10-20 us of the hook's per-step cost."""
    t = type(v)
    if t in _IMMUTABLE:
        return v
    if t is dict and all(type(k) in _IMMUTABLE and type(x) in _IMMUTABLE for k, x in v.items()):
        return dict(v)
    if t is list and all(type(x) in _IMMUTABLE for x in v):
        return list(v)
    if t is tuple and all(type(x) in _IMMUTABLE for x in v):
        return v
    return copy.deepcopy(v)


def pack(obj: Any) -> bytes:
    """Per-rank state as one opaque blob (torch.save handles tensors, tuples, numpy arrays)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes, where: str = "per-rank state") -> Any:
    """The per-rank blob, loaded as data only: ``weights_only=True`` plus numpy arrays (RNG, loader
    states) and plain containers; anything else raises ``DamagedCheckpoint`` (a checkpoint never runs code)."""
    from ..storage.safeload import safe_torch_load  # noqa: PLC0415

    return safe_torch_load(data, where)
