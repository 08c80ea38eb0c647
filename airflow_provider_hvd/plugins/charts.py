"""Metric curves as inline SVG, drawn on the server (the Training tab loads nothing from anywhere else)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 560, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 36
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _span(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:
        pad = abs(low) * 0.05 or 1.0
        return low - pad, high + pad
    return low, high


def _number(value: object) -> float | None:
    """``value`` as a finite float; None for anything else (a gap: the store may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _points(points: object) -> list[tuple[float, float | None]]:
    """``[step, value]`` pairs as numbers (a step that is not one: 0; a value: None, a gap)."""
    if not isinstance(points, list | tuple):
        return []
    pairs = (point for point in points if isinstance(point, list | tuple) and len(point) == 2)
    return [(_number(step) or 0.0, _number(value)) for step, value in pairs]


@dataclass(frozen=True)
class Restart:
    """Where a run's attempt resumed on the curves: its number, the step (None: not known yet, drawn at the curve's
    end) and what a hover says."""

    attempt: int
    step: float | None
    label: str


def chart_svg(
    name: str, points: Sequence[Sequence[float | None]], color: str = _COLORS[0], restarts: Sequence[Restart] = ()
) -> str:
    """One metric's curve: ``points`` are ``[step, value]`` (value None: a gap), with a dashed line at the step
    where each restarted attempt resumed (its label on hover). An SVG element, as text."""
    pairs = _points(points)
    finite = [(step, value) for step, value in pairs if value is not None]
    name = str(name)
    title = f'<text x="{_LEFT}" y="18" class="title">{escape(name)}</text>'
    frame = (
        f'<rect x="{_LEFT}" y="{_TOP}" width="{WIDTH - _LEFT - _RIGHT}" height="{HEIGHT - _TOP - _BOTTOM}" '
        'class="frame"/>'
    )
    if not finite:
        body = f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" class="empty">no value yet</text>'
        return _svg(name, title + frame + body)
    (x0, x1), (y0, y1) = _span([s for s, _ in finite]), _span([v for _, v in finite])
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def x(step: float) -> float:
        return _LEFT + (step - x0) / (x1 - x0) * plot_w

    def y(value: float) -> float:
        return _TOP + (1 - (value - y0) / (y1 - y0)) * plot_h

    commands, pen_down = [], False
    for step, value in pairs:
        if value is None:
            pen_down = False
            continue
        commands.append(f"{'L' if pen_down else 'M'}{x(step):.1f},{y(value):.1f}")
        pen_down = True
    last_step, last_value = finite[-1]
    body = (
        f'<path class="curve" data-metric="{escape(name)}" d="{" ".join(commands)}" stroke="{color}"/>'
        f'<circle cx="{x(last_step):.1f}" cy="{y(last_value):.1f}" r="3" fill="{color}"/>'
        f'<text x="{_LEFT - 6}" y="{_TOP + 4}" class="ytick">{_fmt(y1)}</text>'
        f'<text x="{_LEFT - 6}" y="{HEIGHT - _BOTTOM}" class="ytick">{_fmt(y0)}</text>'
        f'<text x="{_LEFT}" y="{HEIGHT - _BOTTOM + 16}" class="xtick">{_fmt(x0)}</text>'
        f'<text x="{WIDTH - _RIGHT}" y="{HEIGHT - _BOTTOM + 16}" class="xtick end">{_fmt(x1)}</text>'
        f'<text x="{WIDTH - _RIGHT}" y="18" class="last">last: {_fmt(last_value)} at step {_fmt(last_step)}</text>'
    )
    for restart in restarts:
        resumed = _number(restart.step)
        at = x(min(max(resumed, x0), x1)) if resumed is not None else x(last_step)
        line = f'x1="{at:.1f}" x2="{at:.1f}" y1="{_TOP}" y2="{HEIGHT - _BOTTOM}"'
        body += (
            f'<g class="restart" data-attempt="{restart.attempt}"><title>{escape(restart.label)}</title>'
            f'<line {line} class="marker"/><line {line} class="hit"/>'
            f'<text x="{at + 3:.1f}" y="{_TOP + 12}">{restart.attempt}</text></g>'
        )
    return _svg(name, title + frame + body)


def _svg(name: str, content: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" aria-label="{escape(name)}" '
        f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">{content}</svg>'
    )


def charts_html(series: dict[str, Sequence[Sequence[float | None]]], restarts: Sequence[Restart] = ()) -> str:
    """Every metric's chart, in the order the rank first reported them, each with the run's restarts."""
    return "".join(
        chart_svg(name, points, _COLORS[i % len(_COLORS)], restarts) for i, (name, points) in enumerate(series.items())
    )
