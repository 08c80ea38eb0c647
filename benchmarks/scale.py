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

Also the supervisor's py4j calls per second to Spark's status store while the ranks run: at ``np=4`` on a real
``local[4]`` SparkSession (the calls its thread makes, counted at py4j's client), and at ``np=1000`` against a
stand-in of the JVM's status tracker and store (``tests/standin_status.py``; each answer one py4j round trip).
Goal: the same few calls per second whatever np.

Run it from the repository root::

    make bench                                   # runs .venv/bin/python benchmarks/scale.py among others
    .venv/bin/python benchmarks/scale.py --agents 100 1000 --repeats 3 --json /tmp/scale.json
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from peaks import Peaks
from rounds import benchmark_parser, markdown_table, median, quiet_logging, shown, write_json
from simulated_agents import Run, Scenario, drive
from standin_status import StandInJob, standin_launcher

LINES = 20
GOALS = {"started_s": 5.0, "abort_s": 2.0, "rss_mb": 300.0}


_PROCESS = psutil.Process()
RSS_AT_START = _PROCESS.memory_info().rss  # growth is counted from here, before any run (memory a run keeps counts)


def _lines_in_order(run: Run, size: int) -> bool:
    expected = {rank: [f"rank {rank} line {n}" for n in range(LINES)] for rank in range(size)}
    return run.lines == expected


def measure(agents: int, fail: bool, spread_s: float) -> dict[str, Any]:
    scenario = Scenario(
        agents=agents, lines_per_rank=LINES, fail_rank=agents // 2 if fail else None, connect_spread_s=spread_s
    )
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


_WORST = ("threads", "rss_mb")  # the highest over the rounds, not the median


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    numeric = [k for k, v in rounds[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = {k: max(r[k] for r in rounds) if k in _WORST else median([r[k] for r in rounds], 3) for k in numeric}
    for key in rounds[0]:
        if isinstance(rounds[0][key], bool):
            summary[key] = all(r[key] for r in rounds)
    return summary


_SUPERVISOR_POLL_S = 0.2  # the supervisor asks its launcher this often (and at every event)


def standin_calls_per_second(tasks: int, seconds: float) -> float:
    """py4j calls per second of the supervisor's watch on a running barrier job of ``tasks`` tasks (stand-in)."""
    launcher, sc = standin_launcher(StandInJob(group="", tasks=tasks))
    launcher.poll()  # the first poll finds the job
    start, before = time.monotonic(), sc.calls.count
    while time.monotonic() - start < seconds:
        assert launcher.poll() == []
        time.sleep(_SUPERVISOR_POLL_S)
    return round((sc.calls.count - before) / (time.monotonic() - start), 1)


def _sleeping_ranks(seconds: float) -> int:
    import time

    import horovod.torch as hvd

    hvd.init()
    time.sleep(seconds)
    return hvd.size()


def spark_calls_per_second(ranks: int, seconds: float) -> float:
    """py4j calls per second that the supervisor's thread makes while ``ranks`` ranks run on ``local[ranks]``."""
    from pyspark.sql import SparkSession

    from airflow_provider_hvd import HorovodRunner

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(f"local[{ranks}]")
        .appName("py4j-calls")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    client = spark.sparkContext._gateway._gateway_client
    me, calls = threading.get_ident(), []
    send = client.send_command

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.get_ident() == me:
            calls.append(time.monotonic())
        return send(*args, **kwargs)

    started: list[float] = []

    class _Started(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "ranks started" in record.getMessage():
                started.append(time.monotonic())

    handler = _Started()
    logger = logging.getLogger("airflow_provider_hvd.runner")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    client.send_command = counted
    try:
        assert HorovodRunner(np=ranks).run(_sleeping_ranks, seconds=seconds + 2) == ranks
    finally:
        client.send_command = send
        logger.removeHandler(handler)
        spark.stop()
    window = (started[0] + 1, started[0] + 1 + seconds)  # the ranks running, past the start's own calls
    return round(sum(window[0] <= at < window[1] for at in calls) / seconds, 1)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, repeats=3, what="rounds per size")
    parser.add_argument("--agents", type=int, nargs="*", default=[100, 1000], help="none: only the py4j figures")
    parser.add_argument("--spread", type=float, default=0.0, help="agents connect over this many seconds")
    parser.add_argument("--py4j-seconds", type=float, default=6.0, help="how long to count py4j calls (0: skip)")
    args = parser.parse_args(argv)
    quiet_logging()
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
    if args.py4j_seconds:
        figures["py4j_calls_per_s"] = {
            "np=4 local[4]": spark_calls_per_second(4, args.py4j_seconds),
            "np=1000 stand-in": standin_calls_per_second(1000, args.py4j_seconds),
        }
        print(
            "supervisor's py4j calls per second while the ranks run: "
            + ", ".join(f"{k}: {v}" for k, v in figures["py4j_calls_per_s"].items())
        )
    write_json(args.json, figures)
    return 0


def format_table(figures: dict[str, Any]) -> str:
    head = (
        "agents",
        "all started",
        "lines in order",
        "last hello → all started s",
        "abort fan-out s",
        "failure → run() raised s",
        "driver threads",
        "driver RSS growth MB",
    )
    rows = []
    for agents, size in figures["sizes"].items():
        ok, fail = size["ok"], size["fail"]
        rows.append(
            (
                f"{agents:,}",
                str(ok["all_started"] and fail["all_started"]),
                str(ok["lines_in_order"] and fail["lines_in_order"]),
                shown(ok["started_s"], 3),
                shown(fail["abort_s"], 3),
                shown(fail["raised_s"], 3),
                f"+{max(ok['threads'] or 0, fail['threads'] or 0):.0f}",
                shown(max(ok["rss_mb"], fail["rss_mb"]), 1),
            )
        )
    goals = (
        f"goal at 1,000: started ≤ {GOALS['started_s']} s, aborted ≤ {GOALS['abort_s']} s, "
        f"RSS < {GOALS['rss_mb']:.0f} MB"
    )
    title = f"driver at scale (medians; agents connect over {figures['spread_s']} s)"
    return "\n".join([title, markdown_table(head, rows), goals])


if __name__ == "__main__":
    sys.exit(main())
