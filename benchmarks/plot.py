"""Tokens/s timelines as a small SVG (stdlib only: the benchmarks ship without a plotting library)."""

from __future__ import annotations

from html import escape

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
WIDTH, HEIGHT, MARGIN = 720, 360, 48


def timeline_svg(lines: dict[str, list[float]], step_s: float, title: str = "") -> str:
    """One polyline per name: value i at time i * step_s; axes from 0 to the largest time and value."""
    n = max((len(v) for v in lines.values()), default=0)
    top = max((max(v) for v in lines.values() if v), default=0.0) or 1.0
    span_s = max(n - 1, 1) * step_s
    w, h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def xy(i: int, v: float) -> str:
        return f"{MARGIN + w * i * step_s / span_s:.1f},{MARGIN + h * (1 - v / top):.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           'font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="20" text-anchor="middle">{escape(title)}</text>',
           f'<line x1="{MARGIN}" y1="{MARGIN + h}" x2="{MARGIN + w}" y2="{MARGIN + h}" stroke="black"/>',
           f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{MARGIN + h}" stroke="black"/>',
           f'<text x="{MARGIN + w / 2}" y="{HEIGHT - 10}" text-anchor="middle">seconds after the decision '
           f'(0 - {span_s:.1f})</text>',
           f'<text x="12" y="{MARGIN - 8}">tokens/s (max {top:.0f})</text>']
    for k, (name, values) in enumerate(lines.items()):
        colour = COLOURS[k % len(COLOURS)]
        points = " ".join(xy(i, v) for i, v in enumerate(values))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        out.append(f'<text x="{MARGIN + w - 110}" y="{MARGIN + 16 * (k + 1)}" fill="{colour}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
