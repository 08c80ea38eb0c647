"""Launch cost of a submitted run over Spark Connect against run(), and the time a new process takes to
re-attach to a run that goes on.

A trivial 2-rank Horovod job (``benchmarks/rounds.py``'s: ``hvd.init()``, one tiny allreduce, return the rank),
start to rank 0's value, on a Connect server on ``local[3]`` (2 ranks and a submitted run's host), started once
outside the timing:

``run``
    ``HorovodRunner(np=2).run(trivial)``: the supervisor in this process.
``submit+wait``
    ``HorovodRunner(np=2).submit(trivial).wait()``: the supervisor in the run's host, an executor.

Each gets one untimed warm-up, then ``--repeats`` timed runs interleaved round-robin. Then ``--attaches`` times:
a run waiting on a file is submitted, and a new Python process attaches to it; the time from that process's
start (``Popen``) to its ``attach()`` returning. Run it from the repository root::

    .venv/bin/python benchmarks/durable_launch.py --repeats 3 --json /tmp/durable_launch.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' Connect server

import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from connect_launch import connect_figures  # noqa: E402
from connect_launch import format_report as connect_report  # noqa: E402
from connect_server import ConnectServer, connect_session  # noqa: E402
from rounds import (  # noqa: E402
    Method,
    at_least_one,
    benchmark_parser,
    exit_status,
    not_run,
    quiet_logging,
    run_rounds,
    trivial,
    write_json,
)

_ATTACH = (
    "import sys; from airflow_provider_hvd import attach; job = attach(sys.argv[1], logs=False); "
    "print('ATTACHED', flush=True); job.close()"
)


def wait_for_file(path: str) -> int:
    """A run that goes on until ``path`` exists."""
    import time
    from pathlib import Path

    import horovod.torch as hvd

    hvd.init()
    while not Path(path).exists():
        time.sleep(0.1)
    return hvd.rank()


def time_attaches(count: int, scratch: Path) -> list[float]:
    """Each time: submit a run that waits on a file; a new process's start to its ``attach()`` returning."""
    from airflow_provider_hvd import HorovodRunner

    times = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for i in range(count):
        gate = scratch / f"gate-{i}"
        job = HorovodRunner(np=2).submit(wait_for_file, path=str(gate))
        try:
            started = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", _ATTACH, job.id], capture_output=True, text=True, env=env, timeout=300
            )
            if "ATTACHED" not in out.stdout:
                raise RuntimeError(f"the attaching process failed: {out.stdout}{out.stderr}")
            times.append(time.perf_counter() - started)
        finally:
            gate.touch()
            job.wait(300)
        print(f"attach {i + 1}/{count} done", file=sys.stderr, flush=True)
    return times


def format_report(figures: dict[str, Any]) -> str:
    return connect_report(figures, "submit+wait", "run", width=12)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, repeats=3)
    parser.add_argument("--attaches", type=at_least_one, default=3, help="re-attaches from a new process (default 3)")
    args = parser.parse_args(argv)
    quiet_logging()
    from airflow_provider_hvd import HorovodRunner

    scratch = Path(tempfile.mkdtemp(prefix="hvd-bench-durable-"))
    server = ConnectServer(scratch, "local[3]").start()
    try:
        with connect_session(server.url):
            methods = [
                Method("run", "run(): the supervisor in this process", lambda: HorovodRunner(np=2).run(trivial)),
                Method(
                    "submit+wait",
                    "submit().wait(): the supervisor in the run's host",
                    lambda: HorovodRunner(np=2).submit(trivial).wait(300),
                ),
            ]
            run_rounds(methods, args.repeats)
            attaches = time_attaches(args.attaches, scratch)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    figures = connect_figures(methods)
    figures["attach"] = {
        "label": "a new process's start to attach() returning",
        "median_s": statistics.median(attaches),
        "min_s": min(attaches),
        "runs": attaches,
    }
    print(format_report(figures))
    write_json(args.json, figures)
    return exit_status(not_run(methods))


if __name__ == "__main__":
    sys.exit(main())
