"""Bench room: compare `fantai bench serve` JSON results as one chart: output throughput, TTFT and
TPOT (median solid, p99 dashed) against concurrency (or request rate), one colour per run file.
SVG needs nothing; PNG uses matplotlib when it is installed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"]
# (title, metric key, stat or None for a plain number, y label)
PANELS = [("Output throughput", "output_throughput", None, "tokens/s"),
          ("Time to first token", "ttft_ms", "median", "ms"),
          ("Time per output token", "tpot_ms", "median", "ms")]


@dataclass(slots=True)
class Series:
    label: str
    color: str
    xs: list[float]
    runs: list[dict[str, Any]]


def x_of(run: dict[str, Any]) -> float:
    """Concurrency when bounded, else the request rate, else all at once (= num_prompts)."""
    if run.get("max_concurrency"):
        return float(run["max_concurrency"])
    rate = run.get("request_rate")
    if rate is not None and rate != float("inf") and not (isinstance(rate, str)):
        return float(rate)
    return float(run.get("num_prompts", 1))


def x_label(series: list[Series]) -> str:
    runs = [r for s in series for r in s.runs]
    if all(r.get("max_concurrency") for r in runs):
        return "concurrency"
    return "request rate (req/s) / concurrency"


def load_series(paths: list[str]) -> list[Series]:
    out = []
    for i, path in enumerate(paths):
        data = json.loads(Path(path).read_text())
        runs = sorted(data["runs"], key=x_of)
        label = data.get("label") or Path(path).stem
        out.append(Series(label, PALETTE[i % len(PALETTE)], [x_of(r) for r in runs], runs))
    return out


def values(s: Series, key: str, stat: str | None) -> list[float]:
    return [float(r[key] if stat is None else r[key][stat]) for r in s.runs]


def nice_max(v: float) -> float:
    if not v > 0 or math.isnan(v):
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    return next(m * p for m in (1, 2, 2.5, 5, 10) if m * p >= v)


# ---- SVG ---------------------------------------------------------------------------------------
W, H, PW, PAD = 1260, 430, 400, 60


def _panel_svg(ox: int, series: list[Series], panel: tuple[str, str, str | None, str],
               xs_all: list[float]) -> list[str]:
    title, key, stat, unit = panel
    top_vals = [v for s in series for v in values(s, key, stat)]
    if stat is not None:
        top_vals += [v for s in series for v in values(s, key, "p99")]
    ymax = nice_max(max([v for v in top_vals if not math.isnan(v)] or [1.0]))
    x0, y0, pw, ph = ox + PAD, 50, PW - PAD - 10, H - 140
    xpos = {x: x0 + (i + 0.5) * pw / len(xs_all) for i, x in enumerate(xs_all)}
    out = [f'<text x="{ox + PW / 2}" y="28" class="title">{escape(title)} ({unit})</text>']
    for i in range(5):
        y = y0 + ph - ph * i / 4
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" class="ytick">{ymax * i / 4:g}</text>')
    for x, px in xpos.items():
        out.append(f'<text x="{px:.1f}" y="{y0 + ph + 16}" class="xtick">{x:g}</text>')
    out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 34}" class="xtick">'
               f'{escape(x_label(series))}</text>')
    for s in series:
        for st, dash in ((stat, ""), ("p99", ' stroke-dasharray="6 4"')):
            if stat is None and dash:
                continue
            pts = [(xpos[x], y0 + ph - min(v, ymax) / ymax * ph)
                   for x, v in zip(s.xs, values(s, key, st)) if not math.isnan(v)]
            name = f"{s.label}:{key}" + (f":{st}" if st else "")
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            out.append(f'<polyline data-series="{escape(name)}" points="{path}" fill="none" '
                       f'stroke="{s.color}" stroke-width="2"{dash}><title>{escape(name)}</title>'
                       f'</polyline>')
            out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{s.color}"/>'
                    for px, py in pts]
    return out


def to_svg(series: list[Series]) -> str:
    xs_all = sorted({x for s in series for x in s.xs})
    body = ['<rect width="100%" height="100%" fill="#fff"/>']
    for i, panel in enumerate(PANELS):
        body += _panel_svg(i * (PW + 20), series, panel, xs_all)
    ly = H - 40
    for i, s in enumerate(series):
        lx = 70 + i * 230
        body.append(f'<rect x="{lx}" y="{ly - 10}" width="14" height="10" fill="{s.color}"/>')
        body.append(f'<text x="{lx + 20}" y="{ly}" class="legend">{escape(s.label)}</text>')
    body.append(f'<text x="{W - 20}" y="{ly}" class="note">latency: solid = median, '
                f'dashed = p99</text>')
    style = ("<style>text{font-family:sans-serif;fill:#1f2937}.title{font-size:15px;"
             "font-weight:600;text-anchor:middle}.ytick{font-size:11px;text-anchor:end}"
             ".xtick{font-size:11px;text-anchor:middle}.legend{font-size:13px}"
             ".note{font-size:12px;text-anchor:end;fill:#6b7280}.grid{stroke:#e5e7eb}</style>")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
            f'viewBox="0 0 {W} {H}">{style}' + "".join(body) + "</svg>\n")


# ---- PNG (matplotlib, optional) ----------------------------------------------------------------
def to_png(series: list[Series], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("PNG output needs matplotlib (pip install matplotlib); "
                         "or write an .svg, which needs nothing") from exc
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.6))
    for ax, (title, key, stat, unit) in zip(axes, PANELS):
        for s in series:
            ax.plot(s.xs, values(s, key, stat), "o-", color=s.color, label=s.label)
            if stat is not None:
                ax.plot(s.xs, values(s, key, "p99"), "o--", color=s.color, alpha=0.7)
        ax.set_title(f"{title} ({unit})")
        ax.set_xlabel(x_label(series))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.text(0.995, 0.01, "latency: solid = median, dashed = p99", ha="right", fontsize=9,
             color="#6b7280")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot(paths: list[str], out: str | Path) -> Path:
    out = Path(out)
    series = load_series(paths)
    if out.suffix.lower() == ".png":
        to_png(series, out)
    else:
        out.write_text(to_svg(series), encoding="utf-8")
    return out
