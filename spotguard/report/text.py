"""The terminal summary of ``spotguard report`` (the JSON form is ``Figures.to_dict``)."""

from __future__ import annotations

from typing import Optional

from .figures import Figures

__all__ = ["render_text", "duration", "human_bytes"]


def duration(s: Optional[float]) -> str:
    """``3h 04m``, ``4m 05s``, ``1.23 s``: the precision a person reads."""
    if s is None:
        return "-"
    if s >= 3600:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    if s >= 60:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{s:.2f} s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def rows(fig: Figures) -> list[tuple[str, str]]:
    """(label, value) of the summary table, shared by the terminal and the HTML report."""
    by = ", ".join(f"{k} {v}" for k, v in sorted(fig.preemptions_by.items())) or "none"
    out = [
        ("Wall time", duration(fig.wall_seconds)),
        ("Training time", duration(fig.training_seconds)),
        ("Goodput", f"{fig.goodput_percent:.1f} % ({duration(fig.goodput_seconds)} useful)"),
        ("Attempts (starts)", str(len(fig.attempts))),
        ("Preemptions", f"{len(fig.preemptions)} ({by})"),
        ("Lost without a notice", str(fig.interruptions_without_notice)),
        ("Time to safe p50 / max", f"{duration(fig.time_to_safe_p50)} / {duration(fig.time_to_safe_max)}"),
        ("Steps recomputed", f"{fig.steps_recomputed} ({duration(fig.recomputed_seconds)})"),
        ("Downtime", f"{duration(fig.downtime_seconds)} (waiting {duration(fig.waiting_seconds)}, "
                     f"restart + load {duration(fig.restart_load_seconds)})"),
        ("Checkpoints", f"{len(fig.checkpoints)}, {human_bytes(fig.checkpoint_bytes)} in "
                        f"{duration(fig.checkpoint_seconds)}"
                        + (f" ({fig.throughput_mb_s:.1f} MB/s)" if fig.throughput_mb_s is not None else "")),
    ]
    if fig.money is not None:
        m = fig.money
        out.append(("Cost on spot", f"{m['spot_cost']:.2f} ({m['spot_node_hours']:.2f} node-h, "
                                    f"{'up to ' if m.get('nodes_per_attempt') and len({len(a.nodes) for a in fig.attempts}) > 1 else ''}"
                                    f"{int(m['nodes'])} nodes)"))
        out.append(("Same work on demand", f"{m['on_demand_cost']:.2f} ({m['on_demand_node_hours']:.2f} node-h)"))
        out.append(("Saved", f"{m['saved']:.2f} ({m['saved_percent']:.1f} %)"))
    for c in fig.counterfactual:
        lost = f"{c['lost_steps']:.0f} steps, " if c["lost_steps"] is not None else ""
        out.append((f"Periodic every {c['every_minutes']} min, no notice",
                    f"lost {lost}{duration(c['lost_seconds'])}; goodput {c['goodput_percent']:.1f} %"))
    return out


def render_text(fig: Figures, uri: str) -> str:
    width = max(len(k) for k, _ in rows(fig))
    lines = [f"spotguard report: {uri}", ""]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows(fig)]
    if fig.preemptions:
        lines += ["", "  Preemptions:"]
        for p in fig.preemptions:
            lines.append(f"    {p.notice_id}: {p.source}/{p.kind} on {', '.join(p.nodes) or '?'}, step {p.step}, "
                         f"safe in {duration(p.time_to_safe)}")
            if p.writers:
                lines.append(f"      {p.writers}")
    if fig.skipped:
        lines += ["", f"  Skipped {len(fig.skipped)} damaged or foreign history entries:"]
        lines += [f"    {k}: {why}" for k, why in fig.skipped[:20]]
    if not fig.attempts:
        lines += ["", "  No history found (history/ is empty): the job ran without it, or wrote elsewhere."]
    return "\n".join(lines)
