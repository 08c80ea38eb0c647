"""The driver at scale: the real driver side against 100 and 1,000 simulated rank agents.

The driver side is HorovodRunner's own (Supervisor, DriverChannel, RunOutcome, the rendezvous server and rank
plan); the agents are simulated in one child process (``tests/simulated_agents.py``) that speaks the real wire
protocol with the run's secret, 4 agents per loopback address. No Horovod, no rank processes. Each size runs:

``ok``
    every agent says hello (all at once, or spread over ``--spread`` seconds), gets Start, sends 20 numbered
    log lines in batches of 5, then Done (rank 0 a result first);
``fail``
    the same, but once all have started one rank fails and the others wait for the driver's Abort.

Measured (medians over ``--repeats``): seconds from the last hello to the last Start received; abort fan-out
(from the failing rank's report to the last Abort received); seconds from that report until ``run()`` raised;
and, the highest over the rounds: the driver's threads above its count before the run (the simulated
launcher's one reader thread among them), its RSS growth (sampled every 5 ms, from its RSS before any run);
whether every agent started and every rank's lines reached the driver's log complete and in order.
Goal at 1,000 agents: started within 5 s of the last hello, aborted within 2 s, RSS growth under 300 MB.

Run it from the repository root::

    make bench                                   # runs .venv/bin/python benchmarks/scale.py among others
    .venv/bin/python benchmarks/scale.py --agents 100 1000 --repeats 3 --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from peaks import Peaks  # noqa: E402
from simulated_agents import Run, Scenario, drive  # noqa: E402

LINES = 20
GOALS = {"started_s": 5.0, "abort_s": 2.0, "rss_mb": 300.0}


_PROCESS = psutil.Process()
RSS_AT_START = _PROCESS.memory_info().rss  # growth is counted from here, before any run (memory a run keeps counts)


def _lines_in_order(run: Run, size: int) -> bool:
    expected = {rank: [f"rank {rank} line {n}" for n in range(LINES)] for rank in range(size)}
    return run.lines == expected


def measure(agents: int, fail: bool, spread_s: float) -> dict[str, Any]:
    scenario = Scenario(agents=agents, lines_per_rank=LINES, fail_rank=agents // 2 if fail else None,
                        connect_spread_s=spread_s)
    with Peaks(0.005, threads=threading.active_count, rss=lambda: _PROCESS.memory_info().rss) as peaks:
        run = drive(scenario)
    records = run.report.agents
    hellos = [a["hello"] for a in records if "hello" in a]
    starts = [a["start"] for a in records if "start" in a]
    figures: dict[str, Any] = {
        "all_started": len(starts) == agents,
        "agent_errors": sum("error" in a or "turned_away" in a for a in records),
        "run_s": round(run.seconds, 3),
        "started_s": round(max(starts) - max(hellos), 3) if len(starts) == agents else None,
        "threads": peaks.growth("threads"),  # the simulated launcher's reader thread among them
        "rss_mb": round((peaks.peak["rss"] - RSS_AT_START) / 1e6, 1),
        "lines_in_order": _lines_in_order(run, agents),
    }
    if fail:
        aborts = [a["abort"] for a in records if "abort" in a]
        failed_at = run.report.failed_at
        figures["error"] = type(run.error).__name__ if run.error else None
        figures["aborted"] = len(aborts)
        figures["abort_s"] = round(max(aborts) - failed_at, 3) if failed_at and len(aborts) == agents - 1 else None
        figures["raised_s"] = round(run.ended_at - failed_at, 3) if failed_at else None
    else:
        figures["value"] = run.value
    return figures


def _median(values: list[Any]) -> Any:
    numbers = [v for v in values if v is not None]
    return round(statistics.median(numbers), 3) if len(numbers) == len(values) and numbers else None


_WORST = ("threads", "rss_mb")  # the highest over the rounds, not the median


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    numeric = [k for k, v in rounds[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = {k: max(r[k] for r in rounds) if k in _WORST else _median([r[k] for r in rounds]) for k in numeric}
    for key in rounds[0]:
        if isinstance(rounds[0][key], bool):
            summary[key] = all(r[key] for r in rounds)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spread", type=float, default=0.0, help="agents connect over this many seconds")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("airflow_provider_hvd.ranks").propagate = False  # counted, not printed
    figures: dict[str, Any] = {"spread_s": args.spread, "sizes": {}}
    for agents in args.agents:
        ok, fail = [], []
        for round_no in range(args.repeats):
            ok.append(measure(agents, fail=False, spread_s=args.spread))
            fail.append(measure(agents, fail=True, spread_s=args.spread))
            print(f"{agents} agents: round {round_no + 1}/{args.repeats}: {ok[-1]} {fail[-1]}", file=sys.stderr)
        figures["sizes"][agents] = {"ok": summarize(ok), "fail": summarize(fail), "rounds": {"ok": ok, "fail": fail}}
    print(format_table(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def format_table(figures: dict[str, Any]) -> str:
    head = ("agents", "all started", "lines in order", "last hello → all started s", "abort fan-out s",
            "failure → run() raised s", "driver threads", "driver RSS growth MB")
    rows = [head]
    for agents, size in figures["sizes"].items():
        ok, fail = size["ok"], size["fail"]
        rows.append((
            f"{agents:,}", str(ok["all_started"] and fail["all_started"]),
            str(ok["lines_in_order"] and fail["lines_in_order"]), _fmt(ok["started_s"]), _fmt(fail["abort_s"]),
            _fmt(fail["raised_s"]), f"+{max(ok['threads'] or 0, fail['threads'] or 0):.0f}",
            _fmt(max(ok["rss_mb"], fail["rss_mb"]), 1),
        ))
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(head))
    goals = (f"goal at 1,000: started ≤ {GOALS['started_s']} s, aborted ≤ {GOALS['abort_s']} s, "
             f"RSS < {GOALS['rss_mb']:.0f} MB")
    return "\n".join([f"driver at scale (medians; agents connect over {figures['spread_s']} s)", *lines, goals])


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
