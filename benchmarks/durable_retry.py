"""A lost Airflow worker's retry, durable against not: the time from the retry's start to training again.

A real deployment (``airflow standalone`` on PostgreSQL, as tests/test_airflow_deployment.py starts it) and a
Spark Connect server on ``local[3]``. Each round triggers a DAG of ``tests/dags/hvd_durable_dags.py`` (a
2-process ``TorchDistributorOperator`` on the server that trains until a file exists, ``retries=1``,
``retry_delay`` 1 s), waits for its ranks, SIGKILLs the task's process, and measures from the retry's start
(its task instance's ``start_date``) to:

``durable``
    ``durable_training``: the retry's "Attached to the run an earlier try submitted" (the same ranks train on).
``not durable``
    ``not_durable_training`` (``durable=False``): the retry's "2 ranks started" (a new run: its ranks start
    again, from the last checkpoint at best).

Rounds alternate between the two. Run it from the repository root::

    .venv/bin/python benchmarks/durable_retry.py --repeats 2 --json /tmp/durable_retry.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' deployment, PostgreSQL and Connect server
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import contextlib  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import datetime  # noqa: E402
from typing import Any  # noqa: E402

from airflow_deployment import AirflowDeployment  # noqa: E402
from connect_server import ConnectServer  # noqa: E402
from jobs import wait_for_pids  # noqa: E402
from postgres import PostgresServer  # noqa: E402
from rounds import benchmark_parser, write_json  # noqa: E402

DAGS = {"durable": ("durable_training", "Attached to the run an earlier try submitted"),
        "not durable": ("not_durable_training", "TorchDistributor: 2 ranks started")}  # fmt: skip


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _first_record(airflow: AirflowDeployment, dag_id: str, run_id: str, text: str, timeout: float = 300.0) -> float:
    """The timestamp of try 2's first log record that holds ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            records = airflow.task_log(dag_id, run_id, "train", 2)
        except AssertionError:  # the retry has not started
            records = []
        for record in records:
            if text in str(record.get("event", "")) and record.get("timestamp"):
                return _when(str(record["timestamp"]))
        time.sleep(0.2)
    raise TimeoutError(f"no {text!r} in {dag_id}'s retry after {timeout:g}s")


def one_round(airflow: AirflowDeployment, dag_id: str, text: str, scratch: Path) -> float:
    pid_dir, gate = Path(tempfile.mkdtemp(dir=scratch)), scratch / f"gate-{time.monotonic_ns()}"
    run_id = airflow.trigger(dag_id, {"pid_dir": str(pid_dir), "gate": str(gate)})
    try:
        wait_for_pids(str(pid_dir), 2, timeout=300)
        os.kill(airflow.task_instance(dag_id, run_id, "train")["pid"], signal.SIGKILL)
        reached = _first_record(airflow, dag_id, run_id, text)
        ti = airflow.task_instance(dag_id, run_id, "train")
        assert ti["try_number"] == 2, ti
        return reached - _when(ti["start_date"])
    finally:
        gate.touch()
        airflow.wait_for_run(dag_id, run_id, timeout=300)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, repeats=2, what="rounds per kind of retry")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="hvd-bench-retry-"))
    dags = scratch / "dags"
    dags.mkdir()
    (dags / "hvd_durable_dags.py").symlink_to(ROOT / "tests" / "dags" / "hvd_durable_dags.py")
    times: dict[str, list[float]] = {name: [] for name in DAGS}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        postgres = PostgresServer().start()
        stack.callback(postgres.stop)
        (scratch / "connect").mkdir()
        server = ConnectServer(scratch / "connect", "local[3]").start()
        stack.callback(server.stop)
        env = {"AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": server.url.replace("sc://", "spark-connect://")}
        airflow = AirflowDeployment(scratch / "airflow", str(dags), postgres.create_database("bench_retry"), env)
        stack.callback(airflow.stop)
        airflow.start([dag_id for dag_id, _ in DAGS.values()], timeout=300)
        for i in range(args.repeats):
            for name, (dag_id, text) in DAGS.items():
                times[name].append(one_round(airflow, dag_id, text, scratch))
                print(f"{name} {i + 1}/{args.repeats}: {times[name][-1]:.2f}s", file=sys.stderr, flush=True)
    figures: dict[str, Any] = {
        name: {"median_s": statistics.median(runs), "min_s": min(runs), "runs": runs} for name, runs in times.items()
    }
    figures["ratio"] = figures["not durable"]["median_s"] / figures["durable"]["median_s"]
    print(f"retry's start to training again (median of {args.repeats}):")
    print(f"  durable (re-attached):          {figures['durable']['median_s']:6.2f} s")
    print(f"  not durable (its ranks started): {figures['not durable']['median_s']:6.2f} s")
    print(f"  not durable / durable:           {figures['ratio']:6.1f}x")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
