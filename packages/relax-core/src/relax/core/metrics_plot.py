"""Reward / response-length curves from ``metrics.jsonl`` as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PLOT_KEYS = ("reward/mean", "response_length/mean")


def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl file; the last row per step wins (a resumed run may repeat steps)."""
    by_step: dict[int, dict[str, float]] = {}
    for line in Path(metrics_jsonl).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_curves(
    metrics_jsonl: str | Path, out_png: str | Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS
) -> Path:
    """One panel per key (metric vs step); raises ValueError if none of ``keys`` has any value."""
    # Figure + Agg canvas directly: no pyplot global state, no GUI backend, safe in any thread
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_jsonl)
    series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
    if not any(series.values()):
        available = sorted({k for r in rows for k in r} - {"step", "timestamp"})
        raise ValueError(f"{metrics_jsonl}: no values for {list(keys)}; available metrics: {available}")
    fig = Figure(figsize=(7, 2.6 * len(keys)), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key in zip(fig.subplots(len(keys), 1, squeeze=False)[:, 0], keys, strict=True):
        points = series[key]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 50 else None, markersize=3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    ax.set_xlabel("step")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
