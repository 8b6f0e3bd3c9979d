"""The commit protocol: a checkpoint counts only once its commit record exists and checks out.

Layout under the storage root::

    step-00000042/            one folder per checkpoint (DCP shards, .metadata, extras)
    step-00000042/COMMIT.json the commit record, written LAST, atomically
    latest                    a hint ("step-00000042"), written after the commit
    step-00000042/QUARANTINE.json  only if it failed verification (``quarantine.py``)

Why a record listing every file with its size: on an object store or NFS a
crashed rank can leave a folder that *looks* complete; resume must be able to
prove the bytes are all there without trusting ``latest`` or file presence.
One record type is shared by the hook, the CLI and every backend.

The record itself (format 2: CRC32C block checksums of every file, taken from
what the ranks reported writing, and an optional HMAC) is ``record.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..logs import get_logger
from .base import ObjectInfo, Storage, StorageError, join_key
from .integrity import FileDigest
from .quarantine import QUARANTINE_NAME, QuarantineMark, read_mark, record_digest, write_mark
from .record import COMMIT_NAME, FORMAT, KEY_ENV, REASONS, CommitRecord, job_key  # noqa: F401 - re-exported

__all__ = [
    "FORMAT",
    "COMMIT_NAME",
    "LATEST_NAME",
    "REASONS",
    "AlreadyCommitted",
    "CommitRecord",
    "CheckpointInfo",
    "step_dir",
    "parse_step_dir",
    "read_latest",
    "prepare_attempt",
    "commit",
    "scan",
    "newest_committed",
    "checkpoint_info",
    "apply_retention",
    "quarantine",
    "restore_quarantined",
    "delete_quarantined",
    "QUARANTINE_NAME",
]

LATEST_NAME = "latest"
_STEP_RE = re.compile(r"^step-(\d{8,})$")

log = get_logger("spotguard.storage")


class AlreadyCommitted(StorageError):
    """The step's folder already holds a commit record: it is never overwritten or cleared."""

    def __init__(self, step: int, key: str) -> None:
        super().__init__(f"checkpoint {key} (step {step}) is already committed; it is never overwritten")
        self.step = step
        self.key = key


def step_dir(step: int) -> str:
    """The folder key of a step's checkpoint: ``step-%08d``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return "step-%08d" % step


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-NNNNNNNN`` folder name, or None if the name is not one."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


# --- folder states ------------------------------------------------------------


@dataclass
class CheckpointInfo:
    """One ``step-*`` folder as found in storage; ``committed`` means loadable (record checks out)."""

    step: int
    dir: str
    committed: bool
    latest: bool
    record: CommitRecord | None
    problem: str | None
    bytes: int
    mtime: float
    unlisted: list[str] = field(default_factory=list)  # objects in the folder the record does not name
    quarantine: QuarantineMark | None = None  # set aside after failing verification: never loaded, kept
    mark_ignored: str | None = None  # a QUARANTINE.json was there but does not apply (garbage, stale, unsigned)
    record_sha256: str | None = None  # of the commit record's bytes, which a quarantine mark names

    @property
    def state(self) -> str:
        """``committed``, ``quarantined`` or ``incomplete`` (a record that fails its checks is not loadable either)."""
        if self.quarantine is not None:
            return "quarantined"
        return "committed" if self.committed else "incomplete"

    @property
    def has_record(self) -> bool:
        """A commit record file is present (it may still be garbage or contradict the files)."""
        return self.record is not None or (self.problem is not None and not self.problem.startswith("no commit"))


NO_RECORD = "no commit record (save interrupted or still in progress)"


def _check_folder(storage: Storage, step: int, key: str, objects: Mapping[str, ObjectInfo]
                  ) -> tuple[CommitRecord | None, str | None, bytes | None]:
    """Validate one folder; returns (record, problem, record bytes) with problem None when it is loadable."""
    if COMMIT_NAME not in objects:
        return None, NO_RECORD, None
    try:
        raw = storage.read_bytes(join_key(key, COMMIT_NAME))
    except FileNotFoundError:
        return None, NO_RECORD, None
    return (*_check_record(step, key, raw, objects), raw)


def _check_record(step: int, key: str, raw: bytes, objects: Mapping[str, ObjectInfo]
                  ) -> tuple[CommitRecord | None, str | None]:
    try:
        record = CommitRecord.from_json(raw)
    except ValueError as exc:
        return None, f"garbage commit record: {exc}"
    bad_sig = record.signature_problem(job_key())
    if bad_sig:
        return record, bad_sig
    if record.step != step:
        return record, f"step mismatch: folder {key} but its commit record says step {record.step}"
    if not record.files:  # commit() never writes one: it would vouch for nothing
        return record, "commit record lists no files"
    for name, size in sorted(record.files.items()):
        info = objects.get(name)
        if info is None:
            return record, f"missing file {name} (commit record lists {size} bytes)"
        if info.size < size:
            return record, f"truncated shard {name}: {info.size} of {size} bytes"
        if info.size != size:
            return record, f"size mismatch for {name}: {info.size} bytes, commit record says {size}"
    return record, None


def read_latest(storage: Storage) -> str | None:
    """The ``latest`` hint's folder name, or None. Only a hint: never load without the record."""
    try:
        text = storage.read_bytes(LATEST_NAME).decode("utf-8", "replace").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return text if parse_step_dir(text) is not None else None


def _group(objects: list[ObjectInfo]) -> dict[str, dict[str, ObjectInfo]]:
    """Objects by top-level ``step-*`` folder, keyed by their name inside it."""
    folders: dict[str, dict[str, ObjectInfo]] = {}
    for obj in objects:
        head, sep, rest = obj.key.partition("/")
        if sep and parse_step_dir(head) is not None:
            folders.setdefault(head, {})[rest] = obj
    return folders


def _info(storage: Storage, name: str, objects: dict[str, ObjectInfo], latest: str | None,
          marks: bool = True) -> CheckpointInfo:
    """One folder's state; ``marks=False`` looks through a quarantine mark (``restore_quarantined``)."""
    step = parse_step_dir(name)
    assert step is not None
    record, problem, raw = _check_folder(storage, step, name, objects)
    sha = record_digest(raw) if raw is not None else None
    mark: QuarantineMark | None = None
    ignored: str | None = None
    if marks and raw is not None and QUARANTINE_NAME in objects:
        mark, ignored = read_mark(storage, name, step, raw, objects[QUARANTINE_NAME].size, job_key())
        if ignored:
            log.warning("quarantine mark ignored: the checkpoint is verified in full before any load",
                        storage=storage.uri, dir=name, why=ignored,
                        fix="spotguard checkpoints --verify re-marks it if it is damaged; "
                            "--restore STEP removes the mark after a successful re-verify")
        elif problem is None:
            problem = f"quarantined: {mark.describe()}" if mark else None
    own = (COMMIT_NAME, QUARANTINE_NAME)
    unlisted = sorted(n for n in objects if n not in own and (record is None or n not in record.files)) \
        if problem is None else []
    if unlisted:
        log.warning("committed checkpoint holds objects its record does not name; they are never loaded",
                    storage=storage.uri, dir=name, objects=[repr(n) for n in unlisted[:10]], count=len(unlisted))
    return CheckpointInfo(
        unlisted=unlisted,
        step=step,
        dir=name,
        committed=problem is None,
        latest=(name == latest),
        record=record,
        problem=problem,
        bytes=sum(o.size for n, o in objects.items() if n not in own),
        mtime=max((o.mtime for o in objects.values()), default=0.0),
        quarantine=mark,
        mark_ignored=ignored,
        record_sha256=sha,
    )


def scan(storage: Storage) -> list[CheckpointInfo]:
    """Every ``step-*`` folder, oldest step first, each with its state and why it is not loadable."""
    folders = _group(storage.list("step-"))
    latest = read_latest(storage)
    return [_info(storage, name, folders[name], latest) for name in sorted(folders, key=lambda n: parse_step_dir(n) or 0)]


def checkpoint_info(storage: Storage, dirkey: str, marks: bool = True) -> CheckpointInfo:
    """The state of one ``step-*`` folder (as ``scan`` reports it; ``marks=False``: ignoring a quarantine mark)."""
    name = dirkey.strip("/")
    if parse_step_dir(name) is None:
        raise StorageError(f"{name!r} is not a step-NNNNNNNN checkpoint folder")
    objects = _group(storage.list(name + "/")).get(name, {})
    return _info(storage, name, objects, read_latest(storage), marks)


def newest_committed(storage: Storage, below: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint whose commit record checks out; newer bad ones are logged once each and skipped.

    ``below``: only steps lower than this (the previous checkpoint, after one failed
    verification on load). Never trusts ``latest``: it only tells us whether to
    mention that the hint was wrong.
    """
    folders = _group(storage.list("step-"))
    latest = read_latest(storage)
    names = [n for n in folders if below is None or (parse_step_dir(n) or 0) < below]
    for name in sorted(names, key=lambda n: parse_step_dir(n) or 0, reverse=True):
        info = _info(storage, name, folders[name], latest)
        if info.committed:
            if latest is not None and latest != name:
                log.info("latest hint ignored", storage=storage.uri, latest=latest, chosen=name)
            return info
        if info.quarantine is not None:  # its shards are not read again
            log.warning("skipping quarantined checkpoint", storage=storage.uri, dir=name, step=info.step,
                        reason=info.quarantine.describe(),
                        fix="spotguard checkpoints --restore STEP after repairing it, or --delete-quarantined")
            continue
        log.warning(
            "skipping checkpoint that cannot be loaded",
            storage=storage.uri, dir=name, step=info.step, reason=info.problem,
            latest_hint=bool(info.latest),
        )
    return None


# --- writing ------------------------------------------------------------------


def prepare_attempt(storage: Storage, step: int) -> str:
    """Make ``step``'s folder ready for a fresh save and return its key.

    Clears what an earlier, uncommitted attempt left there (DCP must not mix old
    shards with new ones) and aborts orphaned multipart uploads of killed saves. Raises ``AlreadyCommitted`` if the folder holds a
    loadable commit record: a committed checkpoint is never touched. A record
    that is not loadable (quarantined, failing its checks: forged, truncated
    shard) commits nothing, so it is replaced: its record goes first, then the
    rest, and this save really commits. Call on one rank (rank 0), then
    barrier, before any rank writes.
    """
    key = step_dir(step)
    if storage.exists(join_key(key, COMMIT_NAME)):
        info = checkpoint_info(storage, key)
        if info.committed:
            raise AlreadyCommitted(step, key)
        log.warning("replacing a checkpoint that cannot be loaded: this save commits the step anew",
                    storage=storage.uri, dir=key, step=step, state=info.state, reason=info.problem)
        _delete_folder(storage, key, has_record=True)
    # Object stores: a save killed mid-upload leaves unfinished multipart uploads (billed, invisible
    # to listings). No other save of this job runs now, so every one under step-* is an orphan.
    storage.abort_incomplete_uploads("step-")
    leftovers = storage.list(key + "/")
    if leftovers:
        log.info("clearing uncommitted leftovers", storage=storage.uri, dir=key, files=len(leftovers))
        storage.delete_prefix(key + "/")
    return key


def commit(storage: Storage, step: int, record: CommitRecord,
           written: Mapping[str, FileDigest] | None = None) -> CommitRecord:
    """Commit ``step``'s checkpoint: check the files, write the record LAST, then the ``latest`` hint.

    The record names exactly the files that were reported written (``written``:
    every rank's ``Storage.write_log`` for this folder, gathered by the hook;
    None: this process's own log), each with its size and checksum; a listing
    only confirms that each is present with that size. A preset
    ``record.files`` must be a subset of what was written. Objects in the
    folder that no rank wrote are left out (and reported). Every rank's bytes
    must already be written (call after the save's final barrier). Returns the
    record as written.
    """
    key = step_dir(step)
    if record.step != step:
        raise ValueError(f"commit record says step {record.step} but commit() was called for step {step}")
    if written is None:
        written = storage.write_log.peek(key)
    present = {o.key[len(key) + 1:]: o for o in storage.list(key + "/")}
    if present.pop(COMMIT_NAME, None) is not None:  # the listing shows it: no separate HEAD on the critical path
        raise AlreadyCommitted(step, key)
    names = dict(record.files) if record.files else {n: d.size for n, d in written.items()}
    if not names:
        raise StorageError(f"nothing to commit: no file was written under {storage.uri}/{key}/ by this save")
    checksums: dict[str, FileDigest] = {}
    for name, size in names.items():
        o = present.get(name)
        if o is None:
            raise StorageError(f"cannot commit {key}: file {name} is missing")
        if o.size != size:
            raise StorageError(f"cannot commit {key}: {name} has {o.size} bytes, expected {size}")
        d = written.get(name)
        if d is None or d.size != size:
            raise StorageError(f"cannot commit {key}: file {name} was not reported written by this save"
                               + ("" if d is None else f" with {size} bytes (reported {d.size})"))
        checksums[name] = d
    strays = sorted(set(present) - set(names))
    if strays:
        log.warning("objects in the checkpoint folder that no rank wrote are left out of the commit record",
                    storage=storage.uri, dir=key, objects=[repr(n) for n in strays[:10]], count=len(strays))
    record.format = FORMAT
    record.files = names
    record.checksums = checksums
    record.bytes = sum(record.files.values())
    record.sign(job_key())
    data = record.to_json().encode("utf-8")  # validates
    storage.make_durable(key)  # every shard durable before the record exists
    storage.write_bytes(join_key(key, COMMIT_NAME), data)
    storage.write_log.take(key)  # this save is done: its log (and the record's own entry) goes
    _write_latest(storage, step)
    log.info("checkpoint committed", storage=storage.uri, dir=key, step=step, bytes=record.bytes,
             files=len(record.files), reason=record.reason, notice_id=record.notice_id)
    return record


def _write_latest(storage: Storage, step: int) -> None:
    """Point ``latest`` at ``step`` unless it already names a newer committed checkpoint."""
    current = read_latest(storage)
    cur_step = parse_step_dir(current) if current else None
    if cur_step is not None and cur_step > step and storage.exists(join_key(current or "", COMMIT_NAME)) \
            and not storage.exists(join_key(current or "", QUARANTINE_NAME)):
        return
    try:
        storage.write_bytes(LATEST_NAME, (step_dir(step) + "\n").encode())
    except OSError as exc:  # only a hint: the commit already stands
        log.warning("could not write latest hint", storage=storage.uri, step=step, error=str(exc))


def apply_retention(storage: Storage, keep: int | None, *, upto: int | None = None,
                    exclude: "frozenset[str] | set[str]" = frozenset()) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep`` and unloadable folders older than the newest committed.

    ``keep=None`` keeps every committed checkpoint (still clears stale
    incomplete ones). Folders newer than the newest committed one are left alone
    (a save may be in progress). The newest committed checkpoint is never
    deleted. Quarantined checkpoints neither count toward ``keep`` nor as the
    newest, and are never deleted here (the operator's evidence:
    ``spotguard checkpoints --delete-quarantined``). Returns the deleted folder
    keys. Call on one rank.

    From a save (``upto``: the step it just committed), only checkpoints at or
    below that step count or go: a newer committed one was not verified by this
    run, and may be a damaged one whose quarantine mark could not be written or
    read (it must never make retention delete the good ones under it).
    ``exclude``: folders the caller found damaged (neither counted nor deleted).
    A quarantine mark that cannot be read (an I/O error, not bad content) stops
    retention for this save: unknown is not "no mark".
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    infos = scan(storage)
    unread = [i.dir for i in infos if (i.mark_ignored or "").startswith("quarantine mark cannot be read")]
    if unread:
        log.warning("retention skipped: a quarantine mark could not be read", storage=storage.uri, dirs=unread)
        return []
    infos = [i for i in infos if i.dir not in exclude and (upto is None or i.step <= upto)]
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    newest = committed[-1]
    doomed: list[CheckpointInfo] = [i for i in infos
                                    if not i.committed and i.quarantine is None and i.step < newest.step]
    if keep is not None:
        doomed += committed[:-keep] if len(committed) > keep else []
    deleted: list[str] = []
    for info in sorted(doomed, key=lambda i: i.step):
        if info.dir == newest.dir:  # belt and braces
            continue
        _delete_folder(storage, info.dir, info.committed)
        deleted.append(info.dir)
    if deleted:
        log.info("retention deleted checkpoints", storage=storage.uri, deleted=deleted, keep=keep, newest=newest.dir)
    return deleted


def _delete_folder(storage: Storage, dirkey: str, has_record: bool) -> None:
    """Delete a step folder, its record first so a half-deleted folder can never look committed."""
    if has_record:
        storage.delete_prefix(join_key(dirkey, COMMIT_NAME))
    storage.delete_prefix(dirkey + "/")


# --- quarantine ---------------------------------------------------------------


def quarantine(storage: Storage, info: CheckpointInfo, what: str, where: str = "", by: str = "resume") -> bool:
    """Set aside ``info`` (committed, failed verification): write its mark, move the ``latest`` hint off it.

    Best effort, never raises (a store that refuses the write only costs the
    next restart one more full read): returns whether the mark was written.
    """
    if info.record_sha256 is None:
        return False
    try:
        mark = write_mark(storage, info.dir, info.step, info.record_sha256, what, where, by, job_key())
    except Exception as exc:  # noqa: BLE001 - the caller falls back either way
        log.warning("could not write quarantine mark: the next restart verifies this checkpoint again",
                    storage=storage.uri, dir=info.dir, error=f"{type(exc).__name__}: {exc}")
        return False
    log.error("checkpoint quarantined: never loaded again, kept for inspection", storage=storage.uri,
              dir=info.dir, step=info.step, reason=mark.describe(),
              fix="spotguard checkpoints --restore %d after repairing it, or --delete-quarantined" % info.step)
    try:
        if read_latest(storage) == info.dir:
            good = newest_committed(storage, below=info.step)
            if good is not None:
                storage.write_bytes(LATEST_NAME, (good.dir + "\n").encode())
    except Exception as exc:  # noqa: BLE001 - only a hint
        log.warning("could not move the latest hint off a quarantined checkpoint", storage=storage.uri,
                    error=repr(exc))
    return True


def quarantine_dir(storage: Storage, dirkey: str, what: str, where: str = "", by: str = "resume") -> bool:
    """``quarantine`` by folder name (re-reads its record, so the mark names the record that failed)."""
    try:
        info = checkpoint_info(storage, dirkey, marks=False)
    except Exception as exc:  # noqa: BLE001 - best effort, like quarantine()
        log.warning("could not read the checkpoint to quarantine", storage=storage.uri, dir=dirkey, error=repr(exc))
        return False
    return quarantine(storage, info, what, where, by)


def restore_quarantined(storage: Storage, step: int, verify: Any) -> tuple[bool, str]:
    """Lift ``step``'s mark if the checkpoint now checks out in full (``verify(storage, info)`` raises if not).

    Returns (restored, message). A checkpoint that still fails keeps its mark (rewritten with the new reason).
    """
    key = step_dir(step)
    info = checkpoint_info(storage, key, marks=False)
    if info.record is None or not info.committed:
        return False, f"{key} is not a committed checkpoint: {info.problem}"
    if not storage.exists(join_key(key, QUARANTINE_NAME)):
        return False, f"{key} is not quarantined"
    try:
        verify(storage, info)
    except StorageError as exc:
        quarantine(storage, info, getattr(exc, "what", str(exc)), getattr(exc, "where", ""), "checkpoints --restore")
        return False, f"{key} still fails verification: {exc}"
    storage.delete_prefix(join_key(key, QUARANTINE_NAME))
    log.info("quarantine lifted: the checkpoint verified in full", storage=storage.uri, dir=key, step=step)
    return True, f"{key} verified in full; quarantine lifted"


def delete_quarantined(storage: Storage) -> list[str]:
    """Delete every quarantined checkpoint folder (record first); returns their keys."""
    deleted = []
    for info in scan(storage):
        if info.quarantine is not None:
            _delete_folder(storage, info.dir, has_record=True)
            deleted.append(info.dir)
    if deleted:
        log.info("deleted quarantined checkpoints", storage=storage.uri, deleted=deleted)
    return deleted


def prepare_status(storage: Storage, step: int) -> tuple[str, Any]:
    """Rank 0's part of starting a save: ``prepare_attempt``; never raises.

    Returns ``("ok", None)``, ``("already", None)`` (the step is committed) or
    ``("error", message)`` — the value every rank receives before writing.
    """
    try:
        prepare_attempt(storage, step)
    except AlreadyCommitted:
        return ("already", None)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return ("error", f"{type(exc).__name__}: {exc}")
    return ("ok", None)


def commit_and_retain(storage: Storage, step: int, record: CommitRecord, keep: int | None,
                      log: Any, written: Mapping[str, FileDigest] | None = None,
                      exclude: "frozenset[str] | set[str]" = frozenset()) -> tuple[str, Any]:
    """Rank 0's part of a save: commit, then retention; never raises.

    Returns ``("ok", bytes)`` (``("ok", 0)`` when the step was already committed)
    or ``("error", message)`` — the value every rank receives before leaving.
    """
    try:
        rec = commit(storage, step, record, written)
    except AlreadyCommitted:
        return ("ok", 0)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return ("error", f"{type(exc).__name__}: {exc}")
    try:
        apply_retention(storage, keep, upto=step, exclude=exclude)
    except Exception as exc:  # noqa: BLE001 - the commit stands
        log.warning("retention failed", error=repr(exc))
    return ("ok", rec.bytes)

