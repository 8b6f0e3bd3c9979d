"""Resume: load the newest committed checkpoint that verifies, then agree before training.

A damaged checkpoint (a checksum or metadata that fails) is skipped for the
previous committed one on every rank alike; per-rank state follows the
elastic mapping (``elastic.py``) when the world size changed.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional

import torch

from ..storage.commit import (
    newest_committed,
    quarantine_dir,
    scan,
)
from ..storage.integrity import DamagedCheckpoint, damage_in  # noqa: I001
from ..storage.safeload import SafeLoadPlanner
from . import elastic
from . import events as ev
from .settings import LEVEL_EMERGENCY
from .state import copy_buffers, unpack


class ResumeMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def resume(self) -> int:
        """Load the newest committed checkpoint (all ranks call this); the step to continue from, 0 if none.

        Also the one place where ranks agree before training: if a notice is
        already active (e.g. the daemon replayed the one this checkpoint was
        written for), every rank exits at once with ``Preempted``.
        """
        if self._resumed:
            return self._resumed_step
        self._internal = True
        try:
            step, from_notice, dirkey, below, damaged, lineage = 0, None, None, None, [], None
            while True:  # the newest committed checkpoint that verifies; a damaged one is skipped
                found: Any = None
                if self._rank == 0:
                    try:
                        info = newest_committed(self._storage, below=below)
                        found = _set_aside(self._storage) if info is None else (
                            info.dir, info.step, info.record.notice_id if info.record else None,
                            info.record.checksums if info.record and info.record.checksums else None,
                            (info.record.extra.get("lineage") if info.record else None) or None)
                    except Exception as exc:  # noqa: BLE001 - shared with peers, then raised
                        found = ("error", f"{type(exc).__name__}: {exc}")
                found = self._bcast0(found)
                if isinstance(found, tuple) and found and found[0] == "error":
                    raise RuntimeError(f"spotguard: cannot list checkpoints in {self._storage.uri}: {found[1]}")
                if found is None or found[0] == "quarantined":
                    damaged += [d for d in (found[1] if found else []) if d not in damaged]
                    if damaged:  # starting from 0 over quarantined work is the operator's call, never ours
                        raise RuntimeError(
                            f"spotguard: no committed checkpoint in {self._storage.uri} passed verification "
                            f"(damaged: {', '.join(damaged)}); restore them from a backup (then `spotguard "
                            f"checkpoints --restore STEP`), or delete them (`spotguard checkpoints "
                            f"--delete-quarantined URI`, other folders by hand) to start from step 0")
                    step, from_notice, dirkey = 0, None, None
                    break
                dirkey, step, from_notice, digests, lineage = found
                t0 = time.monotonic()
                if digests is None:
                    self._log.warning("commit record has no checksums (older spotguard): loading unverified",
                                      dir=dirkey)
                problem = self._load(dirkey, digests)
                if problem is None:
                    break
                self._log.error("skipping damaged checkpoint", dir=dirkey, step=step, file=problem.where,
                                problem=problem.what)
                damaged.append(dirkey)
                if self._rank == 0:  # the next restart skips it without reading its shards
                    quarantine_dir(self._storage, dirkey, problem.what, problem.where, "resume")
                below = step
            if dirkey is not None:
                self._resumed_dir = dirkey
                if isinstance(lineage, str):
                    self._lineage = lineage  # this run continues the lineage it resumed from
                if from_notice:
                    self._committed_ids.add(from_notice)
                self._log.info(ev.RESUMED, step=step, uri=f"{self._storage.uri}/{dirkey}",
                               from_notice_id=from_notice, seconds=round(time.monotonic() - t0, 3))
            else:
                self._log.info(ev.RESUMED, step=0, uri=None, from_notice_id=None, seconds=0.0)
        finally:
            self._internal = False
        self._steps.set_count(step)
        self._resumed_step = step
        self._resumed = True
        self._damaged_dirs = set(damaged)  # a save at one of these steps must never count it as committed
        self._baseline = self._watch.baseline()  # the loaded state: "trained since?" is measured from here
        self._loop.check_fresh()
        self._agree_at_start()
        self._enable_background()  # implicit mode (hook.range() set its intent first): agree off the training thread
        return step

    def latest(self) -> Optional[str]:
        """Local path of the newest committed checkpoint folder, or None."""
        from ..storage.verify import latest_verified  # noqa: PLC0415

        found = latest_verified(self._storage, self._log)  # object store: downloaded to a local cache first
        return None if found is None else str(found[1])

    def _load(self, dirkey: str, digests: Any = None) -> Optional[DamagedCheckpoint]:
        """Load ``dirkey`` into the state (every rank), each byte verified against ``digests``.

        Returns None, or (every rank alike) the damage that made some rank refuse
        it: its state may then be partly overwritten, and the caller loads an
        older checkpoint over it. Anything else that fails raises.
        """
        damage: Optional[DamagedCheckpoint] = None
        try:
            self._load_into(dirkey, digests)
        except DamagedCheckpoint as exc:
            damage = exc
        except BaseException as exc:  # CheckpointException is a BaseException
            damage = damage_in(exc)
            if damage is None:
                raise
        if self._all_ok(damage is None):
            return None
        return damage or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank found it damaged")

    def _load_into(self, dirkey: str, digests: Any) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_model_state_dict,
            get_optimizer_state_dict,
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        o = self._objs
        meta_ok, meta_err = True, None
        try:
            meta = self._storage.dcp_reader(dirkey, digests).read_metadata()
        except DamagedCheckpoint as exc:
            meta_ok, meta_err = False, exc
        if not self._all_ok(meta_ok):  # no rank enters dcp.load unless every rank can
            raise meta_err or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank refused its metadata")
        saved = elastic.saved_ranks(meta.state_dict_metadata)
        src = elastic.source_rank(saved, self._rank)
        rkey = self._rank_key(src) if src is not None else None
        sd: dict[str, Any] = {}
        partial: set[str] = set()  # optimizers whose checkpoint holds no state for some parameter
        for k, m in o.models.items():
            sd[k] = get_model_state_dict(m)
        for k, opt in o.optimizers.items():
            sd[k] = get_optimizer_state_dict(o.models[o.owner[k]], opt)  # fake step() on a fresh optimizer
            if _state_from_metadata(sd[k], k, o.models[o.owner[k]], meta.state_dict_metadata):
                partial.add(k)
        if rkey is not None:
            sd[rkey] = b""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(sd, storage_reader=self._storage.dcp_reader(dirkey, digests), planner=SafeLoadPlanner(),
                         process_group=self._group)
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            damage = damage_in(exc, self._rank) or damage_in(exc)
            if damage is not None:
                raise damage from None
            raise RuntimeError(
                f"spotguard: checkpoint {self._storage.uri}/{dirkey} does not fit this state dict "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        for k, m in o.models.items():
            set_model_state_dict(m, sd[k])
        for k, opt in o.optimizers.items():
            set_optimizer_state_dict(o.models[o.owner[k]], opt, sd[k],
                                     options=StateDictOptions(strict=False) if k in partial else None)
        per: Any = None
        if rkey is not None:
            try:
                per = unpack(sd[rkey], f"{self._storage.uri}/{dirkey} per-rank state of rank {src}")
            except DamagedCheckpoint as exc:
                meta_err = exc
        if not self._all_ok(meta_err is None):  # every rank, whether or not it reads per-rank state
            raise meta_err or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank refused its state")
        if rkey is None:
            self._log.warning("checkpoint has no per-rank state at all: only model and optimizer restored",
                              dir=dirkey)
            return
        own = src == self._rank
        done = elastic.restore(per, own=own, source=src, scope=o.scope, roles={
            "schedulers": o.schedulers, "scalers": o.scalers, "stateful": o.stateful, "loaders": o.loaders})
        copy_buffers(self._buffers, per.get("buffers", {}))  # global: under DDP rank 0 broadcasts them
        if done.missing:
            self._log.warning("checkpoint has no state for object", keys=done.missing, dir=dirkey)
        old_world = int(per.get("world_size", len(saved)))
        elastic.restore_rng_for(per, done, step=int(per.get("step", 0)), rank=self._rank)  # last
        for obj in o.loaders.values():  # the shipped sampler undoes DataLoader's extra base-seed draw
            note = getattr(obj, "note_resume_rng", None)
            if callable(note):
                note(torch.get_rng_state())
        fwd = per.get("rng_at_forward") if own else None  # see stephooks._realign_rng
        self._book.realign_to(fwd if isinstance(fwd, torch.Tensor) else None)
        if old_world != self._world or not own:
            self._log.info(ev.ELASTIC_RESUME, dir=dirkey, old_world_size=old_world, world_size=self._world,
                           resharded=[*o.models, *o.optimizers],
                           dropped_ranks=[r for r in saved if r >= self._world] if self._rank == 0 else [],
                           **done.fields())

    def _agree_at_start(self) -> None:
        """Wait briefly for the daemon's replay, then one blocking agreement: exit at once if a notice is active."""
        it = self._intake
        if it is not None and os.path.exists(it.socket_path):
            if it.wait_connected(1.0):
                it.replayed.wait(1.0)  # every active notice the daemon replays has been received
        with self._lock:  # rebalance/maintenance replays received before resume() knew they were ours
            ours = [i for i, n in self._pending.items() if not n.emergency and i in self._committed_ids]
            for nid in ours:
                del self._pending[nid]
        for nid in ours:
            self._log.info(ev.NOTICE_IGNORED, notice_id=nid, reason="replayed; its checkpoint is already committed")
        level, deadline_ms = self._local_level()
        if self._dist:
            level, deadline_ms = self._agree.blocking(level, deadline_ms)
        if level >= LEVEL_EMERGENCY:
            notice, _ = self._gather_notice(level, deadline_ms)
            self._log.info(ev.AGREED, notice_id=notice.id, step=self._steps.count, flag=level, action="exit",
                           kind=notice.kind, **self._timing(notice))
            self._exit(notice, None)

    def _warn_unresumed(self) -> None:
        """First step without ``hook.resume()`` (rank 0, once): say so if the storage already holds a checkpoint."""
        self._loop.check_fresh()
        if self._rank != 0:
            return
        try:
            info = newest_committed(self._storage)
        except Exception as exc:  # noqa: BLE001 - a warning must never stop training
            self._log.debug("unresumed check failed", error=repr(exc))
            return
        if info is not None:
            self._log.warning(ev.NOT_RESUMED, uri=f"{self._storage.uri}/{info.dir}", committed_step=info.step,
                              step=self._steps.count,
                              fix="call start = hook.resume() before the first step (or iterate hook.range(total)), "
                                  "or give this run its own storage prefix; its checkpoints are not this run's")


def _state_from_metadata(osd: dict[str, Any], key: str, model: Any, meta: Any) -> bool:
    """Per-parameter optimizer tensors the checkpoint holds that a fresh optimizer has no slot for (DCP
    loads only what the template names): a wrapper whose ``step()`` cannot run the fake step that creates
    them (SAM keeps the weights before its perturbation as ``old_p``). Empty tensors of the saved shape and
    dtype are added to the template so the load fills them. And the other way round: a parameter the checkpoint
    holds no state for (its first gradient came after the saved step: a layer used from a later iteration on)
    has its slot taken out of the template (the fake step made one), so the load neither fails on the missing
    key nor leaves the fake step's zeros as that parameter's state. True when it took a slot out (the optimizer is
    then loaded with ``strict=False``: that parameter has no state, as at the saved step)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415

    state = osd.get("state")
    if not isinstance(state, dict):
        return False
    fqns = sorted({f for n, _ in model.named_parameters() for f in _get_fqns(model, n)}, key=len, reverse=True)
    prefix = f"{key}.state."
    held: set[str] = set()
    for name, md in meta.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        fqn = next((f for f in fqns if rest.startswith(f + ".")), None)
        held.add(fqn if fqn is not None else "")  # "": a name this cannot map (then no slot is taken out)
        if fqn is None or "." in rest[len(fqn) + 1:] or not isinstance(md, TensorStorageMetadata):
            continue
        slot = state.setdefault(fqn, {})
        field_name = rest[len(fqn) + 1:]
        if isinstance(slot, dict) and field_name not in slot:
            slot[field_name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    known = "" not in held and any(n.startswith(f"{key}.") for n in meta)
    gone = [f for f in state if f not in held] if known else []
    for fqn in gone:  # (a checkpoint without this optimizer at all fails the load as before)
        del state[fqn]
    return bool(gone)


def _set_aside(storage: Any) -> Any:
    """Rank 0, when no loadable checkpoint is left: ``("quarantined", dirs)`` if committed work is there, else None.

    Committed work: a quarantined checkpoint, or a folder whose commit record fails its checks (a record
    is written last, so only damage or forgery leaves one over a truncated shard). Starting from step 0
    over it is the operator's decision, never a silent one.
    """
    dirs = [i.dir for i in scan(storage) if i.quarantine is not None or (i.has_record and not i.committed)]
    return ("quarantined", dirs) if dirs else None
