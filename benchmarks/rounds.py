"""What the launch benchmarks share: a way of launching a job, its timings, and rounds that interleave them."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Method:
    """One way of launching a job, and its timings."""

    name: str
    label: str
    launch: Callable[[], object]
    times: list[float] = field(default_factory=list)
    error: str | None = None


def time_once(method: Method) -> None:
    """Run `method` once and record its wall time, or its error (after which it is skipped)."""
    start = time.perf_counter()
    try:
        method.launch()
    except Exception as exc:  # noqa: BLE001 - a failed method is reported as n/a, the others go on
        method.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return
    method.times.append(time.perf_counter() - start)


def run_rounds(methods: list[Method], repeats: int, what: str = "round") -> None:
    """One warm-up of each method, then `repeats` timed rounds, round-robin: each round sees the same load."""
    for method in methods:
        time_once(method)
        method.times.clear()
    for round_no in range(1, repeats + 1):
        for method in methods:
            if method.error is None:
                time_once(method)
        print(f"{what} {round_no}/{repeats} done", file=sys.stderr, flush=True)
