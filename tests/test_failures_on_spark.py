"""Failures on a master that retries tasks (local[2,4]: 4 attempts, as every cluster master allows by default).

Each names its real cause; nothing is left running; the runner and the SparkContext work again afterwards.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from cancels import CancelAtLaunch
from conftest import make_session
from jobs import allreduce_sum, assert_all_gone, cancel_once_running, no_spark_job_left, wait_for_pids

from airflow_provider_hvd import HorovodRunner, LaunchError, RankFailedError, RunCancelledError


@pytest.fixture(scope="module")
def spark_retrying():
    spark = make_session("local[2,4]", **{"spark.executorEnv.OMP_NUM_THREADS": "3"})
    yield spark
    spark.stop()


def sleep_with_a_detached_child(pid_dir: str) -> None:
    """Each rank records its pid and starts a child in a session of its own (out of its process group)."""
    import subprocess
    import sys

    import horovod.torch as hvd

    hvd.init()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    Path(pid_dir, f"child-{hvd.rank()}.pid").write_text(str(child.pid))
    Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_a_lost_agent_is_named_with_its_executor_and_sparks_reason(spark_retrying, pid_dir):
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.update(
            error=pytest.raises(RankFailedError, HorovodRunner(np=2).run, sleep_with_a_detached_child, pid_dir=pid_dir)
        )
    )
    thread.start()
    ranks = wait_for_pids(pid_dir, 2)
    children = [int(p.read_text()) for p in sorted(Path(pid_dir).glob("child-*.pid"))]
    rank1 = int(Path(pid_dir, "rank-1.pid").read_text())
    agent = psutil.Process(rank1).parent().parent()  # rank <- its reaper <- its agent (the Spark task's worker)
    os.kill(agent.pid, signal.SIGKILL)  # as when an executor dies: no goodbye
    thread.join(60)
    assert not thread.is_alive()
    error = outcome["error"].value
    assert error.rank == 1
    assert re.search(
        r"Horovod rank 1 of 2 failed: its agent in Spark task \d \(attempt 0\) on executor \S+ \(127.0.0.1\) "
        r"was lost",
        str(error),
    )
    assert "Python worker exited unexpectedly" in str(error)  # Spark's own reason, not the driver's cancellation
    assert "SPARK_JOB_CANCELLED" not in str(error)
    assert_all_gone(ranks + children, within=10)  # the children that left the rank's process group too
    assert no_spark_job_left(spark_retrying)
    assert HorovodRunner(np=2).run(allreduce_sum)["sum"] == 3.0


def test_cancel_gives_run_cancelled_on_spark_and_the_runner_runs_again(spark_retrying, pid_dir):
    runner = HorovodRunner(np=2)
    error, pids, _ = cancel_once_running(runner, pid_dir)
    assert isinstance(error, RunCancelledError)
    assert "the run was cancelled; every rank was ended" in str(error)
    assert_all_gone(pids, within=5)
    assert no_spark_job_left(spark_retrying)
    assert runner.run(allreduce_sum)["sum"] == 3.0  # a cancelled runner is not stuck cancelled


def test_cancel_during_the_start_gives_run_cancelled(spark_retrying):
    runner = HorovodRunner(np=2)
    handler = CancelAtLaunch(runner)
    logger = logging.getLogger("airflow_provider_hvd.runner")
    logger.addHandler(handler)
    try:
        with pytest.raises(RunCancelledError):
            runner.run(allreduce_sum)
    finally:
        logger.removeHandler(handler)
    assert no_spark_job_left(spark_retrying)


def rank_environment() -> dict:
    import horovod.torch as hvd

    hvd.init()
    return {
        "omp": hvd.allgather_object(os.environ.get("OMP_NUM_THREADS")),
        "fusion": hvd.allgather_object(os.environ.get("HOROVOD_FUSION_THRESHOLD")),
        "rendezvous": os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
    }


def test_explicit_executor_settings_win_and_driver_horovod_settings_reach_the_ranks(spark_retrying, monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.9.9.9")  # HorovodRunner's own: never forwarded
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the driver's: not the executors'
    env = HorovodRunner(np=2).run(rank_environment)
    assert env == {"omp": ["3", "3"], "fusion": ["1048576", "1048576"], "rendezvous": "127.0.0.1"}


def test_a_package_missing_on_the_executors_is_named_at_once(spark_retrying, tmp_path):
    """The executors' Python lacks one of the agent's packages: Spark's reason reaches the driver in seconds."""
    spark_retrying.stop()
    broken = tmp_path / "site"
    broken.mkdir()
    (broken / "psutil.py").write_text("raise ModuleNotFoundError(\"No module named 'psutil'\", name='psutil')\n")
    spark = make_session("local[2,4]", **{"spark.executorEnv.PYTHONPATH": str(broken)})
    try:
        started = time.monotonic()
        with pytest.raises(
            LaunchError, match=r"(?s)local\[2,4\] failed: .*ModuleNotFoundError: No module named 'psutil'"
        ):
            HorovodRunner(np=2).run(allreduce_sum)
        assert time.monotonic() - started < 30  # not the 120 s start timeout
        assert no_spark_job_left(spark)
    finally:
        spark.stop()
