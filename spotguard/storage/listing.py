"""``spotguard checkpoints URI``: what is in a checkpoint store, and which checkpoint resume would load.

Uses the same validation as resume (``commit.scan``), so "committed" here means
exactly "loadable": a folder with a garbage record or a truncated shard shows as
incomplete with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

from ..timefmt import to_rfc3339
from . import StorageError, open_storage
from .commit import CheckpointInfo, read_latest, scan

__all__ = ["add_arguments", "main", "human_size", "render_table"]

EXIT_OK = 0
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", metavar="URI",
                        help="storage URI: file:///abs/path, a plain path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


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


def _state(info: CheckpointInfo, chosen: str | None) -> str:
    if info.committed:
        parts = ["committed"]
        if info.dir == chosen:
            parts.append("newest")
        if info.latest:
            parts.append("latest")
        return ", ".join(parts)
    text = f"incomplete ({info.problem})"
    if info.latest:
        text += ", latest hint ignored"
    return text


def _world(info: CheckpointInfo) -> str:
    """Ranks that wrote the checkpoint (any world size can load it: elastic resume)."""
    return str(info.record.world_size) if info.record is not None else "-"


def render_table(infos: list[CheckpointInfo], chosen: str | None) -> str:
    rows = [("STEP", "WORLD", "SIZE", "TIME (UTC)", "STATE")]
    for info in infos:
        rows.append((
            str(info.step),
            _world(info),
            human_size(info.bytes),
            _when(info).strftime("%Y-%m-%d %H:%M:%S"),
            _state(info, chosen),
        ))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append(f"{r[0]:>{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}".rstrip())
    return "\n".join(lines)


def _to_json(info: CheckpointInfo, chosen: str | None) -> dict[str, Any]:
    return {
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
    }


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        storage = open_storage(args.uri)
        root = storage.local_path("")
        if root is not None and not root.is_dir():
            raise StorageError(f"no such directory: {root}")
        infos = scan(storage)
    except StorageError as exc:
        print(f"spotguard checkpoints: error: {exc}", file=err)
        return EXIT_USAGE
    except OSError as exc:
        print(f"spotguard checkpoints: error: cannot read {args.uri}: {exc}", file=err)
        return EXIT_USAGE
    committed = [i for i in infos if i.committed]
    chosen = committed[-1].dir if committed else None
    if getattr(args, "json", False):
        doc = {
            "uri": storage.uri,
            "latest_hint": read_latest(storage),
            "newest_committed": chosen,
            "checkpoints": [_to_json(i, chosen) for i in infos],
        }
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {storage.uri}", file=out)
        return EXIT_OK
    print(f"checkpoints under {storage.uri}", file=out)
    print(render_table(infos, chosen), file=out)
    if chosen is None:
        print("no committed checkpoint: a resume would start from step 0", file=out)
    else:
        print(f"resume would load {chosen}", file=out)
    return EXIT_OK


if __name__ == "__main__":  # python -m spotguard.storage.listing URI
    _p = argparse.ArgumentParser(prog="spotguard checkpoints")
    add_arguments(_p)
    sys.exit(main(_p.parse_args()))
