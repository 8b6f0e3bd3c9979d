"""``spotguard checkpoints URI``: what is in a checkpoint store, and which checkpoint resume would load.

Uses the same validation as resume (``commit.scan``), so "committed" here means
exactly "loadable": a folder with a garbage record or a truncated shard shows as
incomplete with the reason, a quarantined one (``quarantine.py``) with why and
by which check. Without ``--verify`` the newest committed checkpoint is named as
what resume *tries first* (resume reads and checks every block before it counts);
``--verify`` reads every file of every committed checkpoint, checks it against
the record's checksums, quarantines the damaged ones (the exit code is then 1)
and only then names what resume would load. ``--restore STEP`` lifts a
quarantine after a full re-verify; ``--delete-quarantined`` deletes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

from ..notice import EMERGENCY_KINDS
from ..timefmt import parse_rfc3339, to_rfc3339
from . import StorageError, open_storage
from .commit import CheckpointInfo, delete_quarantined, quarantine, read_latest, restore_quarantined, scan
from .integrity import DamagedCheckpoint
from .verify import verifiable, verify_checkpoint

__all__ = ["add_arguments", "main", "human_size", "render_table"]

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", metavar="URI",
                        help="storage URI: file:///abs/path, a plain path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--verify", action="store_true",
                        help="read every file of every committed checkpoint and check its checksums "
                             "(exit code 1 if any is damaged); damaged ones are quarantined")
    parser.add_argument("--restore", metavar="STEP", type=int, default=None,
                        help="re-verify the quarantined checkpoint of STEP in full and lift its quarantine if it "
                             "checks out (exit code 1 if it still fails)")
    parser.add_argument("--delete-quarantined", action="store_true",
                        help="delete every quarantined checkpoint (they are never loaded; retention keeps them)")


def human_size(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, like the disk tools users compare against)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(info: CheckpointInfo) -> datetime:
    if info.record is not None and info.committed:
        from ..timefmt import parse_rfc3339

        return parse_rfc3339(info.record.created_at)
    return datetime.fromtimestamp(info.mtime, tz=timezone.utc)


def late_seconds(info: CheckpointInfo) -> float | None:
    """How far past its emergency notice's deadline the record was written (None: in time, or no deadline).
    ``created_at`` is taken just before the commit, so this is a lower bound (by milliseconds)."""
    rec = info.record
    if rec is None or not isinstance(rec.extra, dict) or rec.extra.get("notice_kind") not in EMERGENCY_KINDS:
        return None
    try:
        past = (parse_rfc3339(rec.created_at) - parse_rfc3339(str(rec.extra.get("deadline")))).total_seconds()
    except (TypeError, ValueError):
        return None
    return round(past, 3) if past > 0 else None


def writers(info: CheckpointInfo) -> dict[str, Any] | None:
    """The record's ``extra["writers"]`` (who wrote what: bytes per rank, the doomed ranks, when they were safe),
    or None (a record from before notice-aware planning, or a periodic save)."""
    rec = info.record
    w = rec.extra.get("writers") if rec is not None and isinstance(rec.extra, dict) else None
    return w if isinstance(w, dict) else None


def writers_note(info: CheckpointInfo) -> str | None:
    """One phrase for the table when the save was planned around doomed ranks: which, what they wrote, and how
    soon after the save began their bytes were durable (the survivors wrote the replicated state)."""
    return writers_phrase(writers(info))


def writers_phrase(w: Any) -> str | None:
    """``writers_note`` of a ``writers`` value from anywhere (a commit record, a history entry): data, never
    trusted — wrong types give None."""
    w = w if isinstance(w, dict) else None
    doomed = w.get("doomed") if w is not None else None
    if not isinstance(doomed, list) or not doomed:
        return None
    # read from storage (any writer, any version): wrong types give no note, a huge list a short one
    try:
        ranks = sorted(r for r in {int(r) for r in doomed if isinstance(r, (int, str))} if 0 <= r < 1 << 20)
        per = [int(b) for b in w.get("bytes_per_rank", [])] if isinstance(w.get("bytes_per_rank"), list) else []
        mine = sum(per[r] for r in ranks if 0 <= r < len(per))
        secs = w.get("safe_seconds")
        safe = [float(v) for v in secs.values() if v is not None] if isinstance(secs, dict) else []
        evac = w.get("evacuated")
        moved = [(int(e["bytes"]), int(e["to"])) for e in evac.values() if isinstance(e, dict)] \
            if isinstance(evac, dict) else []
    except (TypeError, ValueError, OverflowError, KeyError):
        return None
    if not ranks:
        return None
    when = f"safe {max(safe):.2f} s into the save" if safe else "safe time unknown"
    shown = ",".join(str(r) for r in ranks[:8]) + (f",… ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    to = sorted({t for _, t in moved})
    sent = (f" (evacuated {human_size(sum(b for b, _ in moved))} to rank{'s' if len(to) > 1 else ''} "
            f"{','.join(str(t) for t in to[:8])})") if moved else ""
    return (f"notice on rank{'s' if len(ranks) > 1 else ''} {shown}: wrote "
            f"{human_size(mine)}, {when}{sent}; the others wrote {human_size(sum(per) - mine)}")


def _state(info: CheckpointInfo, chosen: str | None, checks: dict[str, str | None] | None = None) -> str:
    if info.quarantine is not None:
        return f"QUARANTINED ({info.quarantine.describe()}), never loaded" \
            + (", latest hint ignored" if info.latest else "")
    if info.committed:
        parts = ["committed"]
        if checks is not None:
            problem = checks.get(info.dir)
            parts = ["committed, verified"] if problem is None else [f"DAMAGED, quarantined ({problem})"]
        past = late_seconds(info)
        if past is not None:
            parts.append(f"LATE: committed {past:.1f} s after its notice's deadline (a real VM would have been gone)")
        note = writers_note(info)
        if note is not None:
            parts.append(note)
        if info.dir == chosen:
            parts.append("newest")
        if info.latest:
            parts.append("latest")
        if info.dir == chosen and checks is None:
            parts.append("not verified: resume verifies it first")
        if info.mark_ignored:
            parts.append(f"quarantine mark ignored ({info.mark_ignored})")
        if info.unlisted:
            parts.append(f"{len(info.unlisted)} objects not in the record, ignored: "
                         + ", ".join(repr(n) for n in info.unlisted[:3]) + (" ..." if len(info.unlisted) > 3 else ""))
        return ", ".join(parts)
    text = f"incomplete ({info.problem})"
    if info.latest:
        text += ", latest hint ignored"
    return text


def _world(info: CheckpointInfo) -> str:
    """Ranks that wrote the checkpoint (any world size can load it: elastic resume)."""
    return str(info.record.world_size) if info.record is not None else "-"


def _printable(text: str) -> str:
    """Text from storage (a quarantine mark's reason, host) as the terminal may show it: control characters
    (an ANSI/OSC escape in a forged mark) escaped, never sent raw to the operator's terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def render_table(infos: list[CheckpointInfo], chosen: str | None,
                 checks: dict[str, str | None] | None = None) -> str:
    rows = [("STEP", "WORLD", "SIZE", "TIME (UTC)", "STATE")]
    for info in infos:
        rows.append((
            str(info.step),
            _world(info),
            human_size(info.bytes),
            _when(info).strftime("%Y-%m-%d %H:%M:%S"),
            _printable(_state(info, chosen, checks)),
        ))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append(f"{r[0]:>{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}".rstrip())
    return "\n".join(lines)


def _to_json(info: CheckpointInfo, chosen: str | None, checks: dict[str, str | None] | None) -> dict[str, Any]:
    doc = {
        "step": info.step,
        "dir": info.dir,
        "state": info.state,
        "committed": info.committed,
        "latest": info.latest,
        "newest": info.dir == chosen,
        "problem": info.problem,
        "bytes": info.bytes,
        "world_size": info.record.world_size if info.record is not None else None,
        "time": to_rfc3339(_when(info)),
        "record": info.record.to_dict() if info.record is not None else None,
        "unlisted": info.unlisted,
        "quarantine": info.quarantine.to_dict() if info.quarantine is not None else None,
        "quarantine_mark_ignored": info.mark_ignored,
        "late_seconds": late_seconds(info),
        "writers": writers(info),
    }
    if checks is not None and info.dir in checks:
        doc["verified"] = checks.get(info.dir) is None
        doc["damage"] = checks.get(info.dir)
    return doc


def _verify_all(storage: Any, infos: list[CheckpointInfo]) -> dict[str, str | None]:
    """dir -> None (every file checks out) or what is wrong, for each committed checkpoint."""
    out: dict[str, str | None] = {}
    for info in infos:
        if info.quarantine is not None:  # read in full once already: --restore STEP re-verifies it
            out[info.dir] = f"quarantined: {info.quarantine.describe()}"
            continue
        if not info.committed:
            continue
        if not verifiable(info):
            out[info.dir] = "record has no checksums (older spotguard): cannot verify"
            continue
        try:
            verify_checkpoint(storage, info)
            out[info.dir] = None
        except DamagedCheckpoint as exc:
            out[info.dir] = f"{exc.where}: {exc.what}"
            quarantine(storage, info, exc.what, exc.where, "checkpoints --verify")
    return out


def _operate(args: argparse.Namespace, storage: Any, out: TextIO, err: TextIO) -> int | None:
    """``--restore`` / ``--delete-quarantined``: the exit code, or None when neither was asked for."""
    restore = getattr(args, "restore", None)
    if restore is not None:
        if restore < 0:
            print(f"spotguard checkpoints: error: --restore takes a step >= 0, got {restore}", file=err)
            return EXIT_USAGE
        ok, message = restore_quarantined(storage, restore, verify_checkpoint)
        print(message, file=out if ok else err)
        return EXIT_OK if ok else EXIT_DAMAGED
    if getattr(args, "delete_quarantined", False):
        gone = delete_quarantined(storage)
        print(f"deleted {len(gone)} quarantined checkpoint(s)" + (": " + ", ".join(gone) if gone else ""), file=out)
        return EXIT_OK
    return None


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        storage = open_storage(args.uri)
        root = storage.local_path("")
        if root is not None and not root.is_dir():
            raise StorageError(f"no such directory: {root}")
        code = _operate(args, storage, out, err)
        if code is not None:
            return code
        infos = scan(storage)
    except StorageError as exc:
        print(f"spotguard checkpoints: error: {exc}", file=err)
        return EXIT_USAGE
    except OSError as exc:
        print(f"spotguard checkpoints: error: cannot read {args.uri}: {exc}", file=err)
        return EXIT_USAGE
    checks: dict[str, str | None] | None = None
    if getattr(args, "verify", False):
        try:
            checks = _verify_all(storage, infos)
        except (StorageError, OSError) as exc:
            print(f"spotguard checkpoints: error while verifying {args.uri}: {exc}", file=err)
            return EXIT_USAGE
    committed = [i for i in infos if i.committed and (checks is None or checks.get(i.dir) is None)]
    chosen = committed[-1].dir if committed else None
    code = EXIT_DAMAGED if checks is not None and any(v is not None for v in checks.values()) else EXIT_OK
    if getattr(args, "json", False):
        doc = {
            "uri": storage.uri,
            "latest_hint": read_latest(storage),
            "newest_committed": chosen,
            "newest_verified": checks is not None and chosen is not None,
            "quarantined": [i.dir for i in infos if i.quarantine is not None],
            "checkpoints": [_to_json(i, chosen, checks) for i in infos],
        }
        print(json.dumps(doc, indent=2), file=out)
        return code
    if not infos:
        print(f"no checkpoints under {storage.uri}", file=out)
        return EXIT_OK
    print(f"checkpoints under {storage.uri}", file=out)
    print(render_table(infos, chosen, checks), file=out)
    if chosen is None:
        print("no committed checkpoint" + (" passed verification" if checks else "")
              + ": a resume would start from step 0" + (" (or stop, if any is damaged)" if checks else ""), file=out)
    elif checks is not None:
        print(f"resume would load {chosen}", file=out)
    else:
        print(f"resume would try {chosen} first: committed, not verified (resume checks every block and, if it is "
              "damaged, quarantines it and loads the previous committed one); --verify checks now", file=out)
    quarantined = [i for i in infos if i.quarantine is not None]
    if quarantined:
        print(f"quarantined (never loaded, kept by retention): {', '.join(i.dir for i in quarantined)}; "
              "--restore STEP re-verifies one after a repair, --delete-quarantined deletes them", file=out)
    if checks is not None:
        bad = sorted(d for d, v in checks.items() if v is not None)
        print(f"verified {len(checks) - len(bad)} of {len(checks)} committed checkpoints"
              + (f"; damaged: {', '.join(bad)}" if bad else ""), file=out)
    return code


if __name__ == "__main__":  # python -m spotguard.storage.listing URI
    _p = argparse.ArgumentParser(prog="spotguard checkpoints")
    add_arguments(_p)
    sys.exit(main(_p.parse_args()))
