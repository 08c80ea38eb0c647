"""Both runners on an active Spark Connect session (``sc://``): real Connect servers from pyspark's scripts, on
local[2] (whose application encrypts its traffic: the driver channel is TLS) and on the standalone cluster."""

from __future__ import annotations

import logging
import os
import re
import sys
import time

import psutil
import pytest
import torch_jobs
from connect_server import connect_session
from jobs import allreduce_sum, assert_all_gone, cancel_once_running, fail_on_rank, sleep_and_record, train_linear
from test_torch_distributor import check_torchrun_contract

from airflow_provider_hvd import HorovodRunner, LaunchError, RankFailedError, RunCancelledError, TorchDistributor
from airflow_provider_hvd.runner.driver.address import (
    CHANNEL_PORT_CONF,
    CONNECT_BIND_CONF,
    CONNECT_HOST_CONF,
    connect_driver_address,
)
from airflow_provider_hvd.runner.driver.connect_job import MESSAGE_SIZE_CONF, job_limit, message_limit
from airflow_provider_hvd.runner.driver.slots import jvm_mebibytes
from airflow_provider_hvd.runner.driver.spark_cluster import active_session, is_connect


@pytest.fixture
def connect_spark(connect_local):
    """A session of its own for each test: a Connect builder's getOrCreate() would return one made before it,
    whatever its URL."""
    with connect_session(connect_local) as spark:
        yield spark


@pytest.fixture
def runner_log(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    return caplog


def messages(caplog) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


def takes_a_blob(blob: bytes) -> int:
    return len(blob)


def barrier_job_runs(spark, tasks: int = 2) -> bool:
    """A barrier job of ``tasks`` tasks runs on the server: its executors' slots are all free."""

    def task(batches):
        import pyarrow as pa

        yield pa.RecordBatch.from_pydict({"ok": [True]})

    return len(spark.range(tasks, numPartitions=tasks).mapInArrow(task, "ok boolean", barrier=True).collect()) == tasks


def our_processes() -> list[psutil.Process]:
    """This runner's processes on this host beside this test process: agents' reapers and rank processes, of
    this checkout's interpreter (another checkout's test run on the machine has its own) and of this pytest-xdist
    worker (they inherit its PYTEST_XDIST_WORKER through the server and its executors; another worker's runs are
    its own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if sys.executable not in cmdline:
            continue
        if "airflow_provider_hvd.runner.reaper" not in cmdline and "airflow_provider_hvd.runner.rank" not in cmdline:
            continue
        try:
            if worker is not None and proc.environ().get("PYTEST_XDIST_WORKER") != worker:
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(proc)
    return found


def test_horovod_runner_returns_rank_0s_allreduce_over_a_tls_channel(connect_spark, runner_log):
    assert is_connect(connect_spark) and active_session() is connect_spark
    result = HorovodRunner(np=2).run(allreduce_sum)
    assert result == {"rank": 0, "size": 2, "local_size": 2, "sum": 3.0}
    said = messages(runner_log)
    assert re.search(r"a Spark barrier job of 2 tasks over Spark Connect sc://127\.0\.0\.1:\d+ \(local\[2\]\)", said)
    assert "driver channel on 127.0.0.1:" in said  # the server is on this host: its executors reach loopback
    assert re.search(r"TLS 1\.3 \(this run's certificate, SHA-256 \w+", said)  # the server's app encrypts
    assert "spark.network.crypto.enabled=true: Spark's traffic is encrypted" in said


def test_a_failing_rank_is_named_and_its_lines_relayed(connect_spark, runner_log, pid_dir):
    with pytest.raises(RankFailedError) as caught:
        HorovodRunner(np=2, driver_log_verbosity="all").run(fail_on_rank, bad_rank=1, pid_dir=pid_dir)
    error = caught.value
    assert error.rank == 1
    assert str(error).splitlines()[0] == "Horovod rank 1 of 2 failed: ValueError: boom from rank 1"
    assert "[rank 1] rank 1 is about to fail" in messages(runner_log)  # relayed from the server's executor
    assert not our_processes()
    assert barrier_job_runs(connect_spark)


def test_a_cancel_interrupts_the_connect_operation_and_leaves_nothing_running(connect_spark, pid_dir):
    error, pids, _ = cancel_once_running(HorovodRunner(np=2), pid_dir)
    assert isinstance(error, RunCancelledError), error
    assert_all_gone(pids, within=10)
    assert not our_processes()  # no reaper or rank on the server's executors
    started = time.monotonic()
    assert barrier_job_runs(connect_spark)  # both task slots free: no Python worker busy with our tasks
    assert time.monotonic() - started < 60


def test_torch_distributor_all_reduces_over_connect(connect_spark):
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.train_ddp, 3)
    check_torchrun_contract(result["views"], nodes=2)  # one process per task, each task a node
    assert len(result["weights"]) == 4


def test_jobs_that_cannot_run_are_refused_at_once(connect_spark):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* at local\[2\] has 2 at most"):
        HorovodRunner(np=3).run(allreduce_sum)
    blob = b"x" * (33 << 20)  # the server takes messages of 32 MiB at most (tests/conftest.py)
    with pytest.raises(LaunchError) as caught:
        HorovodRunner(np=2).run(takes_a_blob, blob=blob)
    text = str(caught.value)
    assert "The pickled job is 33.0 MiB" in text and "a job of at most 31.0 MiB" in text, text
    assert "(spark.connect.grpc.maxInboundMessageSize on the server" in text and "Make the job smaller" in text
    assert time.monotonic() - started < 30  # nothing was submitted


def test_ranks_run_on_the_standalone_workers(connect_standalone, runner_log):
    with connect_session(connect_standalone) as spark:
        assert active_session() is spark
        with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* has 2 at most"):
            HorovodRunner(np=3).run(allreduce_sum)
        result = HorovodRunner(np=2).run(train_linear, steps=5)
        assert barrier_job_runs(spark)
    # each rank in its executor's directory on its worker (in the Connect session's own folder there)
    assert {re.search(r"/(worker-\d)/app-", cwd)[1] for cwd in result["cwds"]} == {"worker-0", "worker-1"}
    said = messages(runner_log)
    assert re.search(r"over Spark Connect sc://127\.0\.0\.1:\d+ \(spark://127\.0\.0\.1:\d+\)", said)
    assert "TLS 1.3" not in said  # this application does not encrypt: neither does the channel


def test_the_spark_ui_link_of_a_server_on_a_standalone_master_is_its_application_page(
    connect_standalone, standalone_cluster
):
    from airflow_provider_hvd.hooks.spark_ui import connect_ui_url

    with connect_session(connect_standalone) as spark:
        app_id = spark.conf.get("spark.app.id")
        link, why_none = connect_ui_url(spark)
    assert link == f"{standalone_cluster.web_ui}/app/?appId={app_id}", why_none


def test_the_agents_are_told_this_hosts_address_or_the_one_set():
    conf = {"spark.driver.host": "10.1.2.3"}  # what a session reports: the server's driver's
    driver = connect_driver_address(conf.get, "127.0.0.1", local=True)  # executors of the server, on this host
    assert (driver.advertised, driver.bind) == ("127.0.0.1", "127.0.0.1")
    # a server on this host (loopback) whose executors are a cluster's: they are told the server driver's host
    assert connect_driver_address(conf.get, "127.0.0.1", local=False).advertised == "10.1.2.3"
    settings = {CONNECT_HOST_CONF: "gateway.example", CONNECT_BIND_CONF: "0.0.0.0", CHANNEL_PORT_CONF: "7100"}
    driver = connect_driver_address(settings.get, "spark-connect.example", local=False)
    assert (driver.advertised, driver.bind, driver.channel_port) == ("gateway.example", "0.0.0.0", 7100)
    with pytest.raises(LaunchError, match=f"cannot tell this host's address .* set {CONNECT_HOST_CONF}"):
        connect_driver_address({}.get, "no-such-host.invalid", local=False)


def test_the_job_limit_is_the_servers_message_limit_or_a_share_of_its_heap():
    assert message_limit({MESSAGE_SIZE_CONF: "32m"}.get) == 32 << 20
    assert message_limit({MESSAGE_SIZE_CONF: "1048576"}.get) == 1 << 20
    assert message_limit({}.get) == message_limit({MESSAGE_SIZE_CONF: "1g"}.get) == 128 << 20  # the client's own
    assert message_limit({MESSAGE_SIZE_CONF: "4096kb"}.get) == 4 << 20  # Spark's size parser, as the slot count's
    assert jvm_mebibytes("1048576b") == 1 and jvm_mebibytes("2048k") == 2 and jvm_mebibytes("2g") == 2048
    # a 64 MiB job ended a 1 GiB server's SparkContext (OutOfMemoryError), 48 MiB ran: 1/32 of the heap
    assert job_limit({}.get) == (32 << 20, "1/32 of the server's driver heap, spark.driver.memory=1g")
    limit, bound_by = job_limit({"spark.driver.memory": "8g"}.get)
    assert limit == 127 << 20 and bound_by.startswith(MESSAGE_SIZE_CONF)


def test_the_driver_address_set_in_the_connect_session_is_used(connect_spark):
    from airflow_provider_hvd.runner.driver.spark_launch import SparkLauncher

    assert SparkLauncher(connect_spark, 2).driver.advertised == "127.0.0.1"
    connect_spark.conf.set(CONNECT_HOST_CONF, "gateway.example")
    connect_spark.conf.set(CONNECT_BIND_CONF, "0.0.0.0")
    driver = SparkLauncher(connect_spark, 2).driver
    assert (driver.advertised, driver.bind) == ("gateway.example", "0.0.0.0")


def test_a_run_whose_server_dies_ends_within_a_bound_and_leaves_nothing_running(tmp_path, pid_dir):
    """The Connect server killed while the ranks run: the cancel on the clean-up path is one bounded call
    (pyspark's own retries of a call to a dead server take ~10 minutes)."""
    import os
    import signal
    import threading

    from connect_server import ConnectServer
    from jobs import wait_for_pids
    from pyspark.sql.connect.session import SparkSession

    server = ConnectServer(tmp_path, "local[2]").start()
    outcome: list[BaseException] = []
    spark = SparkSession.builder.remote(server.url).getOrCreate()
    try:

        def run() -> None:
            try:
                HorovodRunner(np=2).run(sleep_and_record, pid_dir=pid_dir, seconds=300)
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        pids = wait_for_pids(pid_dir, 2)
        assert server._proc is not None
        os.killpg(server._proc.pid, signal.SIGKILL)  # the server's JVM and its Python workers' parent
        started = time.monotonic()
        thread.join(120)
        ended_in = time.monotonic() - started
        assert not thread.is_alive(), "run() did not end within 120 s of its server's death"
    finally:
        spark.client.set_retry_policies([])  # this session's own end: one try (the hook's end is bounded apart)
        try:
            spark.stop()
        except Exception:  # noqa: BLE001 - its server is gone
            pass
        server.stop()
    assert outcome, "run() returned instead of raising"
    assert_all_gone(pids, within=30)
    assert not our_processes()
    assert ended_in < 120


def test_a_cancel_as_the_job_is_submitted_interrupts_it(connect_spark, pid_dir):
    """A cancel that reaches the server before the job's operation does still ends it, and nothing is left."""
    import threading

    runner = HorovodRunner(np=2)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            runner.run(sleep_and_record, pid_dir=pid_dir, seconds=300)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    def job_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "hvd-spark-job"} - before

    before = {t for t in threading.enumerate() if t.name == "hvd-spark-job"}  # (an earlier test's, stuck)
    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive() and not job_threads():
        time.sleep(0.001)  # the job's thread is building its plan: its operation is not on the server yet
    started = time.monotonic()
    runner.cancel()
    thread.join(60)
    ended_in = time.monotonic() - started
    assert not thread.is_alive() and outcome and isinstance(outcome[0], RunCancelledError), outcome
    assert not job_threads()  # the job's thread has ended
    assert not our_processes()
    assert barrier_job_runs(connect_spark)  # both task slots free
    assert ended_in < 30, ended_in


def test_the_memory_settings_for_a_killed_ranks_evidence_are_read_as_the_launch_begins(connect_spark):
    from airflow_provider_hvd.runner.driver.spark_launch import SparkLauncher

    launcher = SparkLauncher(connect_spark, 2)
    connect_spark.stop()  # as a server in trouble when a rank is killed: no call to it then
    assert launcher.memory_settings() == {"spark.driver.memory": "1g (default)"}


def test_a_thread_without_a_session_of_its_own_runs_on_the_classic_one_not_another_threads_connect_one(
    connect_spark, spark_local
):
    """Another thread's Connect session (e.g. another hook's, which it stops when its job ends) is not taken
    by a thread that has none while a classic SparkContext runs; a thread's own Connect session comes first."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        found = pool.submit(active_session).result()
    assert not is_connect(found) and found.sparkContext is spark_local.sparkContext
    assert active_session() is connect_spark  # this thread's
