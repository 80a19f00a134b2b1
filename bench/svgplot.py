"""A line chart written as SVG with the standard library only: the loss curves of the examples
and benchmarks are drawn on any machine, matplotlib or not (a browser opens the file).

    svgplot.line_chart("loss.svg", {"eager": [...], "forge": [...]}, title=..., xlabel=..., ylabel=...)
"""
from __future__ import annotations

import math
from html import escape
from pathlib import Path

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
W, H = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"axis range [{lo}, {hi}] is not finite")
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / max(n, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int(math.ceil((hi - first) / step - 1e-9)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def line_chart(path, series: dict, *, title: str = "", xlabel: str = "", ylabel: str = "") -> Path:
    """Write ``series`` ({label: [y at x = 0, 1, ...]}, non-finite points left out) to ``path``;
    returns the path."""
    pts = {k: [(i, float(y)) for i, y in enumerate(v) if math.isfinite(float(y))] for k, v in series.items()}
    ys = [y for p in pts.values() for _, y in p]
    if not ys:
        raise ValueError("nothing to plot: every series is empty or non-finite")
    n = max(len(v) for v in series.values())
    yt, xt = ticks(min(ys), max(ys)), ticks(0, max(n - 1, 1))
    y0, y1, x0, x1 = yt[0], yt[-1], xt[0], xt[-1]
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def sx(x):
        return LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return TOP + (y1 - y) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text x="{LEFT + pw / 2}" y="{H - 10}" text-anchor="middle">{escape(xlabel)}</text>',
           f'<text x="16" y="{TOP + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {TOP + ph / 2})">'
           f'{escape(ylabel)}</text>']
    for y in yt:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>')
    for x in xt:
        out.append(f'<text x="{sx(x):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{_fmt(x)}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for j, (label, p) in enumerate(pts.items()):
        colour = COLOURS[j % len(COLOURS)]
        if p:
            xy = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
            out.append(f'<polyline points="{xy}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        ly = TOP + 16 + 16 * j
        out.append(f'<line x1="{LEFT + pw - 170}" x2="{LEFT + pw - 150}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{colour}" stroke-width="2"/><text x="{LEFT + pw - 145}" y="{ly}">{escape(label)}</text>')
    out.append("</svg>\n")
    path = Path(path)
    path.write_text("\n".join(out))
    return path
