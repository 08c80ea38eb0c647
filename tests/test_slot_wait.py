"""A busy cluster is waited for, within a bound; a job that can never fit is refused at once (as sparkdl)."""

from __future__ import annotations

import logging
import select
import subprocess
import sys
import threading
import time

import pytest
from conftest import make_session
from jobs import allreduce_sum

from airflow_provider_hvd import HorovodRunner, LaunchError, RunCancelledError
from airflow_provider_hvd.runner.driver import slots, spark_cluster

# Another Spark application that takes both cores of the cluster until its stdin closes.
HOLDER = """
import sys, time
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master(sys.argv[1]).appName("slot-holder").config("spark.ui.enabled", "false")
         .config("spark.cores.max", "2").config("spark.executor.cores", "1").getOrCreate())
jsc = spark.sparkContext._jsc.sc()
while jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()) < 2:
    time.sleep(0.2)
print("holding", flush=True)
sys.stdin.read()
spark.stop()
"""


@pytest.fixture(scope="module")
def holder(standalone_cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("holder") / "holder.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, standalone_cluster.url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "holding", f"the holder did not start: {log.read_text()}"
        yield proc
    finally:
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def busy_session(standalone_cluster, holder):
    """An application on the cluster while the holder has every core: it has no executor yet."""
    spark = make_session(
        standalone_cluster.url, **{"spark.executor.cores": "1", "spark.cores.max": "2", **standalone_cluster.app_conf}
    )
    yield spark
    spark.stop()


@pytest.fixture
def quick_reports(monkeypatch, caplog):
    monkeypatch.setattr(slots, "REPORT_EVERY_S", 1.0)
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    return caplog


def waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]


@pytest.mark.parametrize(
    ("conf", "slots_at_most"),
    [
        ({}, 4),  # one executor per worker, all its cores
        ({"spark.cores.max": "3"}, 3),
        ({"spark.task.cpus": "2"}, 1),  # 3 // 2 + 1 // 2: a task needs its 2 cores on one worker
        ({"spark.executor.cores": "2"}, 2),  # one 2-core executor, on the 3-core worker
        ({"spark.executor.memory": "3g"}, 0),  # no worker has 3 GiB
        ({"spark.executor.cores": "1", "spark.executor.memory": "1g", "spark.cores.max": "2"}, 2),
    ],
)
def test_standalone_capacity(conf, slots_at_most):
    state = {"workers": [
        {"state": "ALIVE", "cores": 3, "memory": 2048},
        {"state": "ALIVE", "cores": 1, "memory": 2048},
        {"state": "DEAD", "cores": 8, "memory": 65536},
    ]}
    assert slots.standalone_capacity(state, conf) == slots_at_most


def test_master_urls():
    assert spark_cluster.standalone_masters("spark://a:7077,b:7078") == [("a", 7077), ("b", 7078)]
    assert spark_cluster.standalone_masters("spark://[::1]:7077") == [("::1", 7077)]
    assert spark_cluster.standalone_masters("local[2]") == []
    for bad in ("spark://127.0.0.1", "spark://h:7077:7077"):  # no port; a port in the host and the Port field
        with pytest.raises(ValueError, match="needs a host and a port"):
            spark_cluster.standalone_masters(bad)


@pytest.mark.parametrize("bad", [-1, "600", float("nan"), True])
def test_the_bound_is_checked(bad):
    with pytest.raises(ValueError, match="slot_wait_timeout must be a number of seconds >= 0"):
        HorovodRunner(np=2, slot_wait_timeout=bad)


def test_a_job_that_can_never_fit_is_refused_at_once(busy_session):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* has 2 at most"):
        HorovodRunner(np=3, slot_wait_timeout=600).run(allreduce_sum)
    assert time.monotonic() - started < 30  # not the 600 s bound


def test_a_busy_cluster_is_waited_for_up_to_the_bound(busy_session, quick_reports):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"waited 3s for 2 free Spark task slots .* has 0 .*slot_wait_timeout"):
        HorovodRunner(np=2, slot_wait_timeout=3).run(allreduce_sum)
    assert 3 <= time.monotonic() - started < 30
    assert len(waits(quick_reports)) >= 2  # reported as it waits (every 30 s; every 1 s here)
    assert "the application has 0 of the 2 it could hold" in waits(quick_reports)[0]


def test_a_wait_ends_when_the_run_is_cancelled(busy_session):
    runner = HorovodRunner(np=2)
    threading.Timer(1.0, runner.cancel).start()
    started = time.monotonic()
    with pytest.raises(RunCancelledError, match="while waiting for 2 task slots"):
        runner.run(allreduce_sum)
    assert time.monotonic() - started < 15


def test_the_job_runs_once_the_other_application_leaves(busy_session, holder, quick_reports):
    threading.Timer(3.0, holder.stdin.close).start()  # the other application ends in 3 s
    result = HorovodRunner(np=2).run(allreduce_sum)
    assert result["size"] == 2 and result["sum"] == 3.0
    assert waits(quick_reports), "the run did not report its wait"
