"""``spotguard report URI``: what spot cost this job, from its history and commit records.

Reads ``history/`` (``spotguard/history``) and the commit records beside it; prints the summary,
``--json`` for machines, ``--html FILE`` for a self-contained timeline a person can look at.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..history.read import read_history
from ..logs import configure_logging
from ..storage import open_storage
from ..storage.base import StorageError
from ..storage.commit import scan
from .figures import Figures, compute, money
from .text import render_text

__all__ = ["add_arguments", "main", "build_figures"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="the job's storage URI (as given to the hook)")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with a timeline")
    p.add_argument("--price-spot", type=price, help="spot price per node-hour")
    p.add_argument("--price-on-demand", type=price, help="on-demand price per node-hour")
    p.add_argument("--nodes", type=node_count, help="nodes of the job (default: each attempt's own hosts)")


def price(text: str) -> float:
    """A price per node-hour: a finite number >= 0 (argparse turns the ValueError into exit 2)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def node_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def build_figures(uri: str, price_spot: float | None = None, price_on_demand: float | None = None,
                  nodes: int | None = None) -> Figures:
    """Read the history and commit records under ``uri``; the figures."""
    storage = open_storage(uri)
    hist = read_history(storage)
    stored = [(c.step, c.record) for c in scan(storage) if c.committed]
    fig = compute(hist.events, stored=stored, skipped=hist.skipped)
    if price_spot is not None and price_on_demand is not None:
        fig.money = money(fig, price_spot, price_on_demand, nodes)
    elif nodes:
        fig.nodes = nodes
    return fig


def _plain(obj: Any) -> Any:
    """The report's dataclasses as their fields (what ``Figures.to_dict`` gives, without its deep copy)."""
    return vars(obj) if hasattr(obj, "__dataclass_fields__") else str(obj)


def main(args: Any) -> int:
    configure_logging("console", "warning", stream=sys.stderr)
    if (args.price_spot is None) != (args.price_on_demand is None):
        print("spotguard report: --price-spot and --price-on-demand go together", file=sys.stderr)
        return 2
    try:
        fig = build_figures(args.uri, args.price_spot, args.price_on_demand, args.nodes)
    except StorageError as exc:  # a URI that cannot be opened or listed: one line, not a traceback
        print(f"spotguard report: {exc}", file=sys.stderr)
        return 2
    if args.html:
        from .html import render_html  # noqa: PLC0415

        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(render_html(fig, args.uri))
        except OSError as exc:  # a folder that does not exist, no permission: one line, not a traceback
            print(f"spotguard report: cannot write {args.html}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(fig, default=_plain, separators=(",", ":")))  # the C encoder: 10,000 events in well under 1 s
    else:
        print(render_text(fig, args.uri))
        if args.html:
            print(f"\n  HTML report: {args.html}")
    return 0
