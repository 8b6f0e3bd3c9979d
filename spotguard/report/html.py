"""``spotguard report --html``: one self-contained file — a timeline per node/rank and the summary table.

Why no JavaScript and no external resource: the file is opened from a laptop, mailed, attached to
an incident; it must show the same thing offline, in any browser, with nothing to trust. Inline
CSS and one inline SVG; every string from the history is escaped.
"""

from __future__ import annotations

import html
from typing import Any, Optional

from .figures import Figures
from .text import duration, rows

__all__ = ["render_html"]

COLORS = {"load": "#e0a526", "train": "#3a9d5d", "save": "#2f6fd0", "leave": "#9db7e0", "down": "#c9c9c9",
          "notice": "#d33", "deadline": "#d33", "lost": "#222", "periodic": "#1c3f7a"}
_W, _LEFT, _LANE, _TOP = 1100, 170, 34, 30


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


class _Axis:
    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.span = t0, max(t1 - t0, 1e-6)

    def x(self, t: float) -> float:
        return round(_LEFT + (_W - _LEFT - 10) * (t - self.t0) / self.span, 2)


def _rect(ax: _Axis, y: float, a: float, b: float, what: str, title: str, h: float = 18) -> str:
    x0, x1 = ax.x(a), ax.x(max(a, b))
    return (f'<rect x="{x0}" y="{y}" width="{max(0.8, x1 - x0):.2f}" height="{h}" fill="{COLORS[what]}">'
            f"<title>{_e(title)}</title></rect>")


def _lane_shapes(fig: Figures, ax: _Axis, lane: dict[str, Any], y: float) -> list[str]:
    out: list[str] = []
    runs = lane["runs"]
    for j, r in enumerate(runs):
        a = fig.attempts[r["attempt"]]
        start, end = r["start"], max(r["start"], r["end"])
        resumed = min(max(a.resumed, start), end)
        train_end = min(max(a.train_end, resumed), end)
        out.append(_rect(ax, y, start, resumed, "load", f"start + load: {duration(resumed - start)}"))
        out.append(_rect(ax, y, resumed, train_end, "train",
                         f"training from step {a.resume_step}: {duration(train_end - resumed)}"))
        saved = next((p.committed for p in fig.preemptions if p.attempt == r["attempt"] and p.committed), None)
        if train_end < end:
            stop = min(saved, end) if saved is not None else end
            out.append(_rect(ax, y, train_end, stop, "save", f"emergency checkpoint: {duration(stop - train_end)}"))
            out.append(_rect(ax, y, stop, end, "leave", f"exit ({r['end_kind']}): {duration(end - stop)}"))
        if j + 1 < len(runs):
            nxt = runs[j + 1]["start"]
            out.append(_rect(ax, y + 4, end, nxt, "down", f"down: {duration(nxt - end)}", h=10))
    for c in fig.checkpoints:
        if c.reason == "periodic" and lane["rank"] == 0:
            out.append(_rect(ax, y + 18, c.time - c.seconds, c.time, "periodic",
                             f"periodic checkpoint step {c.step}: {duration(c.seconds)}", h=4))
    for n in lane["notices"]:
        x = ax.x(n["time"])
        out.append(f'<path d="M{x - 5},{y - 7} L{x + 5},{y - 7} L{x},{y + 1} Z" fill="{COLORS["notice"]}">'
                   f'<title>{_e(n["source"])} notice {_e(n["notice_id"])}</title></path>')
        if n["deadline"] is not None and n["deadline"] <= ax.t0 + ax.span * 1.02:
            xd = ax.x(min(n["deadline"], ax.t0 + ax.span))
            out.append(f'<line x1="{xd}" y1="{y - 6}" x2="{xd}" y2="{y + 22}" stroke="{COLORS["deadline"]}" '
                       f'stroke-width="2" stroke-dasharray="3,2"><title>deadline of {_e(n["notice_id"])}</title>'
                       "</line>")
    for t in lane["lost"]:
        x = ax.x(t)
        out.append(f'<path d="M{x - 5},{y - 2} L{x + 5},{y + 8} M{x + 5},{y - 2} L{x - 5},{y + 8}" '
                   f'stroke="{COLORS["lost"]}" stroke-width="2"><title>peers lost</title></path>')
    return out


def _timeline(fig: Figures) -> str:
    if not fig.attempts or not fig.lanes:
        return "<p>No history to draw.</p>"
    t0 = min(r["start"] for lane in fig.lanes for r in lane["runs"])
    t1 = max([fig.attempts[-1].end] + [r["end"] for lane in fig.lanes for r in lane["runs"]])
    ax = _Axis(t0, t1)
    height = _TOP + _LANE * len(fig.lanes) + 30
    parts = [f'<svg width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" role="img" '
             'aria-label="timeline per node and rank">']
    for i, lane in enumerate(fig.lanes):
        y = _TOP + i * _LANE
        parts.append(f'<text x="4" y="{y + 14}" class="lbl">{_e(str(lane["node"])[:18])} rank {int(lane["rank"])}</text>')
        parts += _lane_shapes(fig, ax, lane, y)
    axis_y = _TOP + _LANE * len(fig.lanes) + 4
    for k in range(6):
        t = t0 + ax.span * k / 5
        anchor = "end" if k == 5 else "start"
        parts.append(f'<text x="{ax.x(t)}" y="{axis_y + 12}" class="tick" text-anchor="{anchor}">'
                     f"{_e(duration(t - t0))}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _table(pairs: list[tuple[str, str]], head: Optional[tuple[str, ...]] = None) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head) if head else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in pairs)
    return f"<table>{'<tr>' + th + '</tr>' if th else ''}{body}</table>"


def render_html(fig: Figures, uri: str) -> str:
    """The whole page as one string (no external URL anywhere in it)."""
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{_e(k)}</span>'
                     for k, c in (("start + load", COLORS["load"]), ("training", COLORS["train"]),
                                  ("emergency checkpoint", COLORS["save"]), ("exiting", COLORS["leave"]),
                                  ("down", COLORS["down"]), ("periodic checkpoint", COLORS["periodic"]),
                                  ("notice / deadline", COLORS["notice"])))
    pre = [(p.notice_id, f"{p.source}/{p.kind}", ", ".join(p.nodes) or "?", str(p.step), duration(p.time_to_safe))
           for p in fig.preemptions]
    skipped = ("<h2>Skipped history entries</h2>" + _table([(k, w) for k, w in fig.skipped[:50]])
               if fig.skipped else "")
    css = ("body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;"
           "margin-top:24px}table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:4px 10px;"
           "text-align:left}.lbl{font:12px monospace}.tick{font:11px sans-serif;fill:#555}.key{margin-right:14px}"
           ".key i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>spotguard report</title>'
            f"<style>{css}</style></head><body><h1>spotguard report: {_e(uri)}</h1>"
            f"<h2>Timeline per node and rank</h2><div>{legend}</div>{_timeline(fig)}"
            f"<h2>Summary</h2>{_table(rows(fig))}"
            + (f"<h2>Preemptions</h2>{_table(pre, ('notice', 'cloud/kind', 'seen on', 'step', 'time to safe'))}"
               if pre else "")
            + skipped + "<p>Definitions of every figure: docs/report.md in spotguard.</p></body></html>")
