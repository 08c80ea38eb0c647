"""What the benchmarks share: the trivial Horovod job, a way of launching a job and its timings, rounds that
interleave them, and how their figures are summed up, shown and written."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def trivial() -> int:
    """The Horovod job the launch benchmarks run: join the ring, one tiny allreduce, return the rank."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1), name="bench")
    return hvd.rank()


# --- rounds --------------------------------------------------------------------------------------


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


def run_rounds(methods: list[Method], repeats: int, what: str = "round", warm_up: bool = True) -> None:
    """One warm-up of each method (unless not `warm_up`), then `repeats` timed rounds, round-robin: each round
    sees the same load."""
    for method in methods if warm_up else ():
        time_once(method)
        method.times.clear()
    for round_no in range(1, repeats + 1):
        for method in methods:
            if method.error is None:
                time_once(method)
        print(f"{what} {round_no}/{repeats} done", file=sys.stderr, flush=True)


def not_run(methods: Iterable[Method]) -> list[str]:
    """`name: error` for each method that has no timing (its figures are n/a)."""
    return [f"{m.name}: {m.error or 'no run'}" for m in methods if m.error or not m.times]


def exit_status(not_run: Sequence[str]) -> int:
    """A benchmark's exit status: 1 if a method (ours or a peer) did not run, named on stderr; else 0."""
    for line in not_run:
        print(f"did not run: {line}", file=sys.stderr)
    return 1 if not_run else 0


# --- figures -------------------------------------------------------------------------------------


def median(values: Sequence[float | None], digits: int) -> float | None:
    """The median of one figure over the rounds, rounded; None unless every round has it."""
    numbers = [v for v in values if v is not None]
    return round(statistics.median(numbers), digits) if numbers and len(numbers) == len(values) else None


def launch_figures(methods: Sequence[Method], ratios: Iterable[tuple[str, str]], digits: int) -> dict[str, Any]:
    """Per method its times, median and min (None once it failed), rounded to `digits`; and for each pair of
    names in `ratios` the first's median over the second's (None where either has none)."""
    figures: dict[str, Any] = {"methods": {}, "ratios": {}}
    for m in methods:
        ok = m.times and m.error is None
        figures["methods"][m.name] = {
            "label": m.label,
            "times_s": [round(t, digits) for t in m.times],
            "median_s": median(m.times, digits) if ok else None,
            "min_s": round(min(m.times), digits) if ok else None,
            "error": m.error,
        }
    by_name = figures["methods"]
    for num, den in ratios:
        a, b = (by_name.get(name, {}).get("median_s") for name in (num, den))
        figures["ratios"][f"{num}/{den}"] = round(a / b, 2) if a and b else None
    return figures


# --- showing and writing them --------------------------------------------------------------------


def shown(value: float | None, digits: int = 2, unit: str = "") -> str:
    """A figure as printed: `digits` decimals and its unit, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """`rows` under `head` as a Markdown table, ready for docs/benchmarks.md."""
    lines = ["| " + " | ".join(row) + " |" for row in (head, *rows)]
    lines.insert(1, "|" + "---|" * len(head))
    return "\n".join(lines)


def at_least_one(text: str) -> int:
    """An argparse type: a count of at least 1."""
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {count}")
    return count


def benchmark_parser(
    doc: str, repeats: int | None = None, what: str = "timed launches per method", check: bool = False
) -> argparse.ArgumentParser:
    """The benchmark's parser (its description `doc`'s first line) with `--json`, `--repeats` (`what` is
    repeated, default `repeats`) where the benchmark repeats, and `--check` where it warms up."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if repeats is not None:
        parser.add_argument("--repeats", type=at_least_one, default=repeats, help=f"{what} (default {repeats})")
    if check:
        parser.add_argument(
            "--check",
            action="store_true",
            help="one run of each method, no warm-up: whether each runs (exit status 1 if one did not; the figures "
            "mean little)",
        )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    return parser


def write_json(path: str | None, figures: object) -> None:
    """The figures as JSON to `path` (`--json`), if one was given."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")


# --- the driver's side ---------------------------------------------------------------------------


def quiet_logging(level: int = logging.WARNING) -> None:
    """Warnings and errors on stderr, this package's from `level` up: the figures stay readable."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("airflow_provider_hvd").setLevel(level)


def local_spark(cores: int) -> SparkSession:
    """A warm `local[cores]` SparkSession, without the console progress bar and the JVM's warnings."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(f"local[{cores}]").config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
