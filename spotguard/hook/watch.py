"""Proof that the model did not move since the end of iteration S: the watch behind the any-moment fast path.

The background save (``save.py``: ``_save_staged``) reads parameters while the
training thread goes on. That read equals the state at the end of iteration S
only if nothing wrote a parameter (or a buffer the snapshot does not hold)
between step S's post-hook and the end of the read. Two signals prove it:

- every tensor's ``_version`` (bumped by every in-place op, ``copy_``,
  ``detach().copy_()``, ``load_state_dict``, foreach updates), and the identity
  of each parameter (a module attribute replaced by a new ``Parameter``);
- a count of ``Parameter.data`` gets and sets on the watched parameters (a
  class-level property on ``torch.nn.Parameter``; other parameters are not
  counted): writes through ``param.data`` (torch_ema's swap, ``p.data.clamp_``
  weight clipping, ``vector_to_parameters``) bypass ``_version``
  (a measured trap), so any access at all counts as "may have written".

``StateWatch.mark()`` runs in the clock's post-hook of every step (one
``_version`` read per tensor: ~0.1 us each); ``changed()`` compares. When it
says "changed" (or cannot tell) the save does not read in the background: it
waits for the training thread at its next ``optimizer.step()`` pre-hook, where
the loop's work after step S (EMA swapped back, weights clipped, SAM's
perturbation undone) is over, and reads there (the exact fallback).

Buffers: every persistent buffer is copied at each mark when they total at most
``SNAPSHOT_ALL_BUFFERS`` bytes (BatchNorm statistics, spectral norm's ``_u``/``_v``
move during the next forward); beyond that, the normalisation layers' statistics
and every buffer seen to change between two marks are.

Disable the ``Parameter.data`` watch with ``SPOTGUARD_WATCH_PARAM_DATA=0``
(then every background save takes the fallback: exact, one iteration slower).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Optional

import torch

from .settings import env_bytes
from .state import tracked_buffers

__all__ = ["StateWatch", "data_accesses", "watch_param_data", "unwatch_param_data", "SNAPSHOT_ALL_BUFFERS",
           "snapshot_buffers", "model_snapshot_buffers"]

#: persistent buffers up to this many bytes (all models together) are all copied at every mark
SNAPSHOT_ALL_BUFFERS = env_bytes("SPOTGUARD_SNAPSHOT_BUFFER_BYTES", 16 << 20)

_lock = threading.Lock()
_users = 0
_count = [0]  # Parameter.data gets + sets since the patch went in (a list: one C-level increment site)
_orig: Any = None
_watched: dict[int, int] = {}  # id of a watched parameter -> how many watches hold it (others are not counted)
_last: dict[int, int] = {}  # id of a watched parameter -> the count at its last ``.data`` get/set (StateWatch.excuse)


def data_accesses() -> Optional[int]:
    """How many ``Parameter.data`` gets/sets so far; None when the watch is off (nothing can be proven)."""
    return _count[0] if _users > 0 else None


def watch_param_data() -> bool:
    """Count ``Parameter.data`` accesses (refcounted, process-wide); False when switched off by env."""
    global _users, _orig
    if os.environ.get("SPOTGUARD_WATCH_PARAM_DATA", "1").strip() == "0":
        return False
    with _lock:
        if _users == 0:
            _orig = torch._C.TensorBase.__dict__["data"]
            orig = _orig
            count = _count

            watched = _watched
            last = _last

            def get(self: Any) -> Any:
                i = id(self)
                if i in watched:
                    count[0] += 1
                    last[i] = count[0]
                return orig.__get__(self, type(self))

            def put(self: Any, value: Any) -> None:
                i = id(self)
                if i in watched:
                    count[0] += 1
                    last[i] = count[0]
                orig.__set__(self, value)

            prop = property(get, put, doc=orig.__doc__)
            for cls in _data_classes():
                cls.data = prop  # type: ignore[attr-defined]
        _users += 1
    return True


def _data_classes() -> list[type]:
    """``Parameter``, and ``DTensor`` where torch has it (FSDP2's sharded parameters are DTensors, not
    ``Parameter`` instances)."""
    out: list[type] = [torch.nn.Parameter]
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        out.append(DTensor)
    except Exception:  # noqa: BLE001 - torch without DTensor
        pass
    return out


def _hold(ids: list[int], delta: int) -> None:
    with _lock:
        for i in ids:
            n = _watched.get(i, 0) + delta
            if n > 0:
                _watched[i] = n
            else:
                _watched.pop(i, None)
                _last.pop(i, None)


def unwatch_param_data() -> None:
    global _users
    with _lock:
        if _users <= 0:
            return
        _users -= 1
        if _users == 0:
            for cls in _data_classes():
                if "data" in cls.__dict__:
                    delattr(cls, "data")


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in skip:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def snapshot_buffers(persistent: Mapping[str, Mapping[str, torch.Tensor]],
                     norm: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """The buffers a snapshot copies, by model key: every persistent one while they total at most
    ``SNAPSHOT_ALL_BUFFERS`` bytes (spectral norm's ``_u``/``_v`` and a user's counters move in forward too),
    else the normalisation layers' running statistics. Same sizes on every rank, same answer."""
    total = sum(b.numel() * b.element_size() for bufs in persistent.values() for b in bufs.values())
    return {k: dict(v) for k, v in (persistent if total <= SNAPSHOT_ALL_BUFFERS else norm).items() if v}


def model_snapshot_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``snapshot_buffers`` of one model, by buffer name (what the framework adapters rewind between micro-batches)."""
    return snapshot_buffers({"m": _persistent_buffers(model)}, {"m": tracked_buffers(model)}).get("m", {})


def fsdp2_params(model: torch.nn.Module) -> Optional[list[tuple[str, torch.Tensor]]]:
    """(FQN, sharded DTensor parameter) of every FSDP2 parameter of ``model``, read from FSDP2's own records
    (which module, which attribute), never from the module's registered parameters: those are swapped for
    unsharded ones during forward/backward. None when the layout is not one this understands (a parameter
    outside FSDP2, shared parameters, another torch version's internals)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

        names = {id(m): n for n, m in model.named_modules()}
        out: list[tuple[str, torch.Tensor]] = []
        for mod in model.modules():
            if not isinstance(mod, FSDPModule):
                continue
            group = mod._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
            for fp in (group.fsdp_params if group is not None else []):
                info = fp._module_info
                if getattr(info, "shared_modules", None):
                    return None
                prefix = names[id(info.module)]
                name = f"{prefix}.{info.param_name}" if prefix else info.param_name
                fqns = _get_fqns(model, name)
                if len(fqns) != 1:
                    return None
                out.append((next(iter(fqns)), fp.sharded_param))
        count = sum(1 for _ in model.parameters())
        return out if out and len(out) == count else None
    except Exception:  # noqa: BLE001 - internals moved: the fallback read stays exact
        return None


def is_fsdp2(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``): its state-dict hooks reshard parameters, so they must run on the training thread."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class StateWatch:
    """Version marks of every parameter and untracked buffer of the dict's models (see the module docstring)."""

    def __init__(self, models: Mapping[str, torch.nn.Module], norm_buffers: Mapping[str, Mapping[str, torch.Tensor]]
                 ) -> None:
        self._params = [p for m in models.values() for p in m.parameters()]
        self._bufs = {k: _persistent_buffers(m) for k, m in models.items()}
        self.tracked: dict[str, dict[str, torch.Tensor]] = snapshot_buffers(self._bufs, norm_buffers)
        self.fsdp = any(is_fsdp2(m) for m in models.values())
        # FSDP2: the sharded parameters by model (FQN, DTensor), what a background read may take instead of
        # the module's state dict (whose hooks reshard under the training thread); None = not understood.
        self.sharded: Optional[dict[str, list[tuple[str, torch.Tensor]]]] = None
        if self.fsdp:
            got = {k: fsdp2_params(m) for k, m in models.items() if is_fsdp2(m)}
            if all(v is not None for v in got.values()) and all(is_fsdp2(m) for m in models.values()):
                self.sharded = got  # type: ignore[assignment]
        self._models = dict(models)
        self._mark: Optional[tuple[list[int], list[int], list[int], Optional[int]]] = None
        # parameters whose state of the mark a copy holds (stepcopy.py): their own writes since the mark do not
        # count as "changed" (cleared at every mark)
        self.skip: frozenset[int] = frozenset()
        self.data_watch = watch_param_data()
        # Flat lists, so that a mark reads versions only (walking the module tree costs ~5 us per module);
        # rebuilt when ``changed`` finds a parameter replaced or a buffer joins the snapshot.
        self._plist: list[torch.Tensor] = []
        self._ulist: list[tuple[str, str, torch.Tensor]] = []
        self._refresh()

    def _refresh(self) -> None:
        old = [id(p) for p in self._plist]
        self._plist = self._params_now()
        if self.data_watch:  # only accesses to these parameters' .data count
            _hold([id(p) for p in self._plist], +1)
            _hold(old, -1)
        self._ulist = [(k, n, b) for k, bufs in self._bufs.items() for n, b in bufs.items()
                       if n not in self.tracked.get(k, {})]
        self._stale = False

    def close(self) -> None:
        if self.data_watch:
            _hold([id(p) for p in self._plist], -1)
            self.data_watch = False
            unwatch_param_data()

    def _params_now(self) -> list[torch.Tensor]:
        if self.sharded is not None:  # FSDP2: the sharded parameters (stable objects) and their local shards
            ps: list[torch.Tensor] = []
            for k, m in self._models.items():
                now = fsdp2_params(m)
                if now is None:
                    raise RuntimeError("FSDP2 parameters no longer readable from FSDP2's records")
                for _, p in now:
                    ps += [p, p._local_tensor]  # type: ignore[attr-defined]
            return ps
        return [p for m in self._models.values() for p in m.parameters()]

    def _read(self, walk: bool = False) -> tuple[list[int], list[int], list[int], Optional[int]]:
        """(parameter ids, their versions, untracked buffer versions, data count); ``walk``: the parameters
        the modules hold now (to see a replaced one), else the cached list."""
        ps = self._params_now() if walk else self._plist
        return ([id(p) for p in ps], [p._version for p in ps], [b._version for _, _, b in self._ulist],
                data_accesses())

    def mark(self) -> None:
        """Training thread, right after optimizer step S — and again at the model's first training-mode
        forward after it, where the loop's post-step writes (an ``AveragedModel`` update, weight clipping, an
        EMA swapped back after evaluation) are over and belong to iteration S: the state the background read
        must still see.

        Untracked buffers that moved since the previous mark (a forward updates
        them) join the snapshot from now on.
        """
        if self._stale:
            self._refresh()
            self._mark = None
        prev = self._mark
        cur = self._read()
        if prev is not None and prev[2] != cur[2]:
            for (k, n, b), v0, v1 in zip(self._ulist, prev[2], cur[2]):
                if v0 != v1:
                    self.tracked.setdefault(k, {})[n] = b
            self._refresh()
            cur = self._read()
        self._mark = cur
        self.skip = frozenset()

    def untouched(self, params: list[torch.Tensor]) -> bool:
        """Whether nothing wrote ``params`` since the mark: the same objects, versions and no ``.data`` access
        (what a copy of their state at the mark taken now needs; stepcopy.py)."""
        mark = self._mark
        if mark is None or mark[3] is None or data_accesses() is None:
            return False
        at = {i: v for i, v in zip(mark[0], mark[1])}
        return all(at.get(id(p)) == p._version and _last.get(id(p), 0) <= mark[3] for p in params)

    def excuse(self, params: list[torch.Tensor]) -> None:
        """A copy now holds these parameters' state of the mark: ``changed`` ignores their writes until the next
        mark."""
        self.skip = self.skip | frozenset(id(p) for p in params)

    def current(self) -> Any:
        """The mark in force (pass it to ``changed`` to check a read against the mark it started from)."""
        return self._mark

    def changed(self, mark: Any = None) -> Optional[str]:
        """None when nothing the background read depends on moved since ``mark`` (default: the last), else why."""
        if self.fsdp and self.sharded is None:
            return "FSDP2 state-dict hooks must run on the training thread (parameters not readable from FSDP2)"
        mark = self._mark if mark is None else mark
        if mark is None:
            return "no optimizer step seen yet"
        ids, vers, bufs, data = mark
        try:
            cur_ids, cur_vers, cur_bufs, cur_data = self._read(walk=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a module tree changing under us: cannot prove anything
            return f"cannot read the parameters' versions: {type(exc).__name__}: {exc}"
        if data is None or cur_data is None:
            return "Parameter.data watch is off (SPOTGUARD_WATCH_PARAM_DATA=0)"
        if cur_ids != ids:
            self._stale = True  # the next mark starts from the parameters the modules hold now
            return "a parameter was replaced"
        skip = self.skip
        if cur_vers != vers and (not skip or any(v0 != v1 and i not in skip for i, v0, v1 in zip(ids, vers, cur_vers))):
            return "a parameter was written outside optimizer.step()"
        if cur_bufs != bufs:
            return "a buffer was written outside the snapshot"
        if cur_data != data and (not skip or any(_last.get(i, 0) > data for i in ids if i not in skip)):
            return "Parameter.data was used outside optimizer.step()"
        return None

    def baseline(self) -> tuple[list[int], list[int], Optional[int]]:
        """Parameter identities, versions and the data count now (to tell later whether anything trained)."""
        ids, vers, _, data = self._read(walk=True)
        return ids, vers, data

    def moved_since(self, base: tuple[list[int], list[int], Optional[int]]) -> bool:
        ids, vers, data = self.baseline()
        return ids != base[0] or vers != base[1] or (data is not None and base[2] is not None and data != base[2])
