"""Launch time of HorovodRunner over Spark Connect against the classic path, in one process, one run.

A trivial 2-rank Horovod job (``hvd.init()``, one tiny allreduce, return the rank), start to rank 0's value:

``classic``
    ``HorovodRunner(np=2).run(trivial)`` on a warm classic ``local[2]`` SparkSession in this process.
``connect``
    the same on a warm Spark Connect session (``sc://``) to a Connect server on ``local[2]`` (pyspark's own
    ``sbin/start-connect-server.sh``, started once outside the timing, as the tests start it).

Each gets one untimed warm-up, then ``--repeats`` timed runs interleaved round-robin (``benchmarks/rounds.py``).
The Connect runs go from a thread of their own, where the Connect session is the active one; the classic runs
from the main thread, where the classic session is. Run it from the repository root::

    .venv/bin/python benchmarks/connect_launch.py --repeats 4 --json /tmp/connect_launch.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' Connect server

import logging  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

from connect_server import ConnectServer  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from rounds import Method, benchmark_parser, exit_status, not_run, run_rounds, trivial, write_json  # noqa: E402


def connect_figures(methods: list[Method]) -> dict[str, Any]:
    """Per method its median, min and runs in seconds, or its error."""
    return {
        m.name: {"label": m.label, "median_s": statistics.median(m.times), "min_s": min(m.times), "runs": m.times}
        if m.times
        else {"label": m.label, "error": m.error}
        for m in methods
    }


def format_report(figures: dict[str, Any], num: str = "connect", den: str = "classic", width: int = 8) -> str:
    """A line per figure, then ``num``'s median over ``den``'s where every figure has one."""
    lines = [
        f"{name:<{width}} median {info['median_s']:.2f}s  min {info['min_s']:.2f}s  ({info['label']})"
        if "median_s" in info
        else f"{name:<{width}} n/a: {info['error']}"
        for name, info in figures.items()
    ]
    if all("median_s" in info for info in figures.values()):
        lines.append(f"{num} / {den} (median): {figures[num]['median_s'] / figures[den]['median_s']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = benchmark_parser(__doc__, repeats=4).parse_args(argv)
    logging.getLogger("airflow_provider_hvd").setLevel(logging.WARNING)
    from airflow_provider_hvd import HorovodRunner

    classic = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    server = ConnectServer(Path(tempfile.mkdtemp(prefix="hvd-bench-connect-"))).start()
    connect_thread = ThreadPoolExecutor(max_workers=1)  # its thread's active session is the Connect one
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        connect_thread.submit(lambda: ConnectSession.builder.remote(server.url).getOrCreate()).result()

        def run_connect() -> object:
            return connect_thread.submit(lambda: HorovodRunner(np=2).run(trivial)).result()

        methods = [
            Method("classic", "classic local[2] session", lambda: HorovodRunner(np=2).run(trivial)),
            Method("connect", f"Spark Connect {server.url} (local[2])", run_connect),
        ]
        run_rounds(methods, args.repeats)
    finally:
        connect_thread.submit(lambda: ConnectSession.getActiveSession() and ConnectSession.getActiveSession().stop())
        connect_thread.shutdown(wait=True)
        server.stop()
        classic.stop()
    figures = connect_figures(methods)
    print(format_report(figures))
    write_json(args.json, figures)
    return exit_status(not_run(methods))


if __name__ == "__main__":
    sys.exit(main())
