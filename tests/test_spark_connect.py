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
from jobs import (
    allreduce_sum,
    assert_all_gone,
    cancel_once_running,
    fail_on_rank,
    hold_slots_until,
    sleep_and_record,
    train_linear,
)
from test_torch_distributor import check_torchrun_contract

from airflow_provider_hvd import (
    HorovodRunner,
    HostSlotError,
    LaunchError,
    RankFailedError,
    RunCancelledError,
    TorchDistributor,
)
from airflow_provider_hvd.runner.driver.launch.address import (
    CHANNEL_PORT_CONF,
    CONNECT_BIND_CONF,
    CONNECT_HOST_CONF,
    connect_driver_address,
)
from airflow_provider_hvd.runner.driver.launch.spark import encryption
from airflow_provider_hvd.runner.driver.launch.spark.capacity import jvm_mebibytes
from airflow_provider_hvd.runner.driver.launch.spark.cluster import active_session, is_connect
from airflow_provider_hvd.runner.driver.launch.spark.connect import MESSAGE_SIZE_CONF, job_limit, message_limit


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
    this checkout's interpreter and PYTHONPATH (another checkout's test run on the machine may share the
    interpreter, never its PYTHONPATH's entries, which Spark's Python workers keep) and of this pytest-xdist worker
    (they inherit its PYTEST_XDIST_WORKER through the server and its executors; another worker's runs are its
    own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    ours = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if sys.executable not in cmdline:
            continue
        if "airflow_provider_hvd.runner.reaper" not in cmdline and "airflow_provider_hvd.runner.rank" not in cmdline:
            continue
        try:
            environ = proc.environ()
        except psutil.NoSuchProcess:
            continue
        if worker is not None and environ.get("PYTEST_XDIST_WORKER") != worker:
            continue
        if not set(ours) <= set(environ.get("PYTHONPATH", "").split(os.pathsep)):  # another checkout's
            continue
        found.append(proc)
    return found


def test_horovod_runner_returns_rank_0s_allreduce_over_a_tls_channel(connect_spark, runner_log, monkeypatch):
    assert is_connect(connect_spark) and active_session() is connect_spark
    monkeypatch.setattr(encryption, "_warned", set())  # once per process: an earlier module's run may have said it
    result = HorovodRunner(np=2).run(allreduce_sum)
    assert result == {"rank": 0, "size": 2, "local_size": 2, "sum": 3.0}
    said = messages(runner_log)
    assert re.search(r"a Spark barrier job of 2 tasks over Spark Connect sc://127\.0\.0\.1:\d+ \(local\[\*\]\)", said)
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
    """The server is on local[*] (its 2 cores, the slots Spark gives it): a known size, checked at once as a
    local[N] one is. Before: the cores of local[*] were unknown, and a submitted run of 2 ranks waited
    slot_wait_timeout (600 s) for the third slot its host needs."""
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* at local\[\*\] has 2 at most"):
        HorovodRunner(np=3).run(allreduce_sum)
    with pytest.raises(
        HostSlotError,
        match=r"^TorchDistributor\(num_processes=2\)'s 2 ranks fit the cluster at local\[\*\] \(2 Spark task slots at "
        r"most\), but a submitted run needs 1 more for its host, .* Give the cluster one more task slot, lower "
        r"num_processes to at most 1, or use run\(\)",
    ):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).submit(allreduce_sum)
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


def test_a_submitted_runs_lost_host_is_found_ended_by_the_next_attach(connect_standalone, tmp_path):
    """The run's host (its Python worker, on a standalone worker) is killed while the run trains: Spark retries its
    task, which finds the first attempt gone and marks the run lost. An attach right after the kill, while its
    host's link refuses it and Spark still runs the task, finds the run ended and ends what is left of it (a retry
    of an Airflow task then starts a new run), instead of saying that it needs a route to the executors."""
    import json
    import signal

    from jobs import train_until_gate, wait_for_pids

    from airflow_provider_hvd import HorovodRunnerError, JobNotFoundError, attach
    from airflow_provider_hvd.runner.durable.host import connection_string, open_session
    from airflow_provider_hvd.runner.durable.link import LINK_CONF, LinkAddress

    gate = tmp_path / "gate"
    with connect_session(connect_standalone) as spark:
        job = HorovodRunner(np=1).submit(train_until_gate, pid_dir=str(tmp_path), gate=str(gate))
        try:
            pids = wait_for_pids(str(tmp_path), 1, timeout=180)
            run = open_session(connection_string(spark)[0], json.loads(job.id)["session_id"])
            host = LinkAddress.from_conf(str(run.conf.get(LINK_CONF)))
            run.client.close()
            os.kill(host.pid, signal.SIGKILL)
            with pytest.raises(JobNotFoundError, match=r"has ended: the run's host was lost \(its task or executor"):
                attach(job.id)
            assert_all_gone(pids, within=30)
            with pytest.raises(HorovodRunnerError, match=r"has ended: its Spark Connect session was closed"):
                job.wait(60)  # (its link was lost with the host: it attached again)
            with pytest.raises(JobNotFoundError, match=r"has ended: its Spark Connect session was closed"):
                attach(job.id)  # nothing of the run is left
        finally:
            gate.touch()


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
    from airflow_provider_hvd.runner.driver.launch.spark.barrier import SparkLauncher

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
    # (with their agents gone with the server, each reaper ends its rank by itself, and exits just after it)
    assert_all_gone([proc.pid for proc in our_processes()], within=15)
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
    from airflow_provider_hvd.runner.driver.launch.spark.barrier import SparkLauncher

    launcher = SparkLauncher(connect_spark, 2)
    connect_spark.stop()  # as a server in trouble when a rank is killed: no call to it then
    assert launcher.memory_settings() == {"spark.driver.memory": "1g (default)"}


def test_pyspark_still_has_the_private_client_parts_the_runner_relies_on(connect_spark):
    """An upgrade of pyspark that renames one fails here, naming it (the runner then falls back to the public
    calls with a WARNING: the cancel and the release are no longer bounded)."""
    import pyspark

    from airflow_provider_hvd.runner.driver.launch.spark.connect_client import PARTS, missing_parts

    missing = missing_parts(connect_spark)
    assert not missing, f"pyspark {pyspark.__version__} lacks " + "; ".join(f"{p} ({PARTS[p]})" for p in missing)


def test_a_cancel_on_a_pyspark_without_its_private_interrupt_falls_back_to_interrupt_tag(
    connect_spark, pid_dir, runner_log, monkeypatch
):
    """A pyspark that renamed a part the bounded interrupt needs (removing this one's would break pyspark's own
    interruptTag, which uses it too): the cancel is pyspark's public interruptTag, with a WARNING naming it."""
    from airflow_provider_hvd.runner.driver.launch.spark import connect_client

    renamed = "SparkConnectClient._interrupt_request_of_another_version"
    monkeypatch.setitem(connect_client.PARTS, renamed, connect_client.PARTS["SparkConnectClient._interrupt_request"])
    monkeypatch.setattr(connect_client, "_CANCEL", (renamed, *connect_client._CANCEL[1:]))
    error, pids, _ = cancel_once_running(HorovodRunner(np=2), pid_dir)
    assert isinstance(error, RunCancelledError), error
    assert_all_gone(pids, within=10)
    warnings = [r.getMessage() for r in runner_log.records if r.levelno == logging.WARNING]
    assert any(f"has no {renamed}" in w and "the run's cancel is pyspark's interruptTag" in w for w in warnings)
    assert "could not end" not in messages(runner_log)
    assert barrier_job_runs(connect_spark)  # the job's operation was interrupted: both task slots free


class Planted:
    """A value whose unpickling on the driver leaves a file: what an intruder's "result" could run there."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.path),))


def plant(path: str) -> Planted:
    return Planted(path)


def returns_ok() -> str:
    return "ok"  # no collective: a run whose ranks need not meet rank 0


def test_an_agent_that_read_the_plan_and_joined_first_fails_the_run_before_its_result_is_read(
    connect_spark, monkeypatch, tmp_path
):
    """Over a Spark Connect channel without TLS the plan, and the run's secret in it, can be read on the way: an
    intruder that joins as Spark task 0 before the real agents (here: with the secret the plan carries) must
    not get its result unpickled by the driver."""
    import threading

    from airflow_provider_hvd.runner.agent import agent as agent_module
    from airflow_provider_hvd.runner.agent.agent import run_agent
    from airflow_provider_hvd.runner.driver.launch.spark.barrier import SparkLauncher
    from airflow_provider_hvd.runner.shared.messages import Hello
    from airflow_provider_hvd.runner.shared.payload import dumps_job

    marker = tmp_path / "unpickled-on-the-driver"
    evil = dumps_job(plant, (), {"path": str(marker)})
    said_hello = threading.Event()
    intruders: list[threading.Thread] = []
    real_send, real_start = agent_module.send, SparkLauncher.start

    def send(stream, message):
        real_send(stream, message)
        if isinstance(message, Hello) and threading.current_thread().name == "intruder":
            said_hello.set()

    def start(self, args, payload):  # the intruder has what the plan carries: the driver's address, the secret
        hello = Hello(host="", pid=0, executor="203.0.113.9:40000", partition=0, attempt=0, cpus=1)
        thread = threading.Thread(target=run_agent, args=(args, lambda: evil, hello), name="intruder")
        intruders.append(thread)
        thread.start()
        assert said_hello.wait(30)  # its hello is the driver's first
        real_start(self, args, payload)

    monkeypatch.setattr(agent_module, "send", send)
    monkeypatch.setattr(SparkLauncher, "start", start)
    with pytest.raises(Exception, match="Someone outside this run knows its secret") as caught:
        HorovodRunner(np=2).run(returns_ok)
    for thread in intruders:
        thread.join(60)
    assert "two agents said they run Spark task 0 (attempt 0)" in str(caught.value) or "another took its place" in str(
        caught.value
    )
    assert not marker.exists()
    assert not our_processes()
    assert barrier_job_runs(connect_spark)


def test_a_tasks_own_agent_that_finds_its_place_taken_after_every_rank_returned_fails_the_run(tmp_path):
    """Before: on a loaded host the job's own agent of task 0 came after the ranks of the intruder that had its
    place, and of task 1, had returned (the run above: DID NOT RAISE); the run had ended, and the intruder's
    result was unpickled. The order is forced here: that agent says hello once the run is ending."""
    import threading

    from airflow_provider_hvd.runner.agent.agent import run_agent
    from airflow_provider_hvd.runner.driver.launch.local import LocalLauncher
    from airflow_provider_hvd.runner.driver.watch.supervisor import Supervisor
    from airflow_provider_hvd.runner.shared.messages import Hello
    from airflow_provider_hvd.runner.shared.payload import dumps_job

    marker = tmp_path / "unpickled-on-the-driver"
    evil = dumps_job(plant, (), {"path": str(marker)})

    class TaskZeroComesLate(LocalLauncher):
        """Agents as a barrier job's tasks say hello: an intruder in task 0's place, task 1's own agent, and
        task 0's own agent once the run is ending."""

        supervisor: Supervisor

        def start(self, args, payload):
            def agent(job: bytes, partition: int, executor: str, late: bool = False) -> None:
                deadline = time.monotonic() + 60
                while late and self.supervisor.status()[0] != "ending" and time.monotonic() < deadline:
                    time.sleep(0.05)
                hello = Hello(host="", pid=os.getpid(), executor=executor, partition=partition, attempt=0, cpus=1)
                try:
                    run_agent(args, lambda: job, hello)
                except OSError:
                    pass  # (before: the driver had gone)

            agents = [(evil, 0, "203.0.113.9:40000"), (payload, 1, "127.0.0.1:40001"), (payload, 0, "127.0.0.1:40000")]
            self._threads = [
                threading.Thread(target=agent, args=(*what, i == 2), name=f"agent-{i}") for i, what in enumerate(agents)
            ]
            for thread in self._threads:
                thread.start()

    launcher = TaskZeroComesLate(2, use_gpus=False)
    launcher.supervisor = Supervisor(launcher, dumps_job(returns_ok, (), {}), "all", lambda: False, 60)
    with pytest.raises(Exception, match="Someone outside this run knows its secret") as caught:
        launcher.supervisor.run()
    assert "two agents said they run Spark task 0 (attempt 0), from" in str(caught.value), caught.value
    assert not marker.exists()
    assert launcher.ended()


def test_a_plaintext_connect_channel_to_a_driver_beyond_loopback_is_warned_of_once(
    connect_spark, runner_log, monkeypatch
):
    from airflow_provider_hvd.runner.driver.launch.spark import connect

    monkeypatch.setattr(connect, "_warned_readable", set())  # (an earlier test's launcher may have said it)

    def warnings() -> list[str]:
        return [
            r.getMessage() for r in runner_log.records if "is not encrypted (no use_ssl, no token)" in r.getMessage()
        ]

    assert HorovodRunner(np=2).run(allreduce_sum)["sum"] == 3.0  # on loopback: nothing to say
    assert not warnings()
    connect_spark.conf.set(CONNECT_BIND_CONF, "0.0.0.0")  # every interface (as in a container)
    connect_spark.conf.set(CONNECT_HOST_CONF, "127.0.0.1")
    assert HorovodRunner(np=2).run(allreduce_sum)["sum"] == 3.0
    with pytest.raises(LaunchError, match="needs 3 Spark task slots"):
        HorovodRunner(np=3).run(allreduce_sum)
    (warning,) = warnings()
    assert (
        "the run's secret travels inside the barrier job's plan" in warning
        and "reaches the driver at 0.0.0.0" in warning
    )
    assert "use_ssl=true or a token" in warning and "docs/security.md" in warning


def test_a_busy_cluster_is_waited_for_up_to_slot_wait_timeout_over_connect(connect_standalone, runner_log, tmp_path):
    """Another session's job holds both cores of the server's application: the run waits for them, counted by
    the server's Spark UI, up to slot_wait_timeout (not the ranks' 120 s start timeout), saying what it waits
    for; once they are free it runs."""
    import threading

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.runner.driver.launch.spark.cluster import session_conf
    from airflow_provider_hvd.runner.driver.launch.spark.connect import ConnectApp
    from airflow_provider_hvd.runner.driver.launch.spark.server_ui import executor_slots, server_ui
    from airflow_provider_hvd.runner.shared.naming import HOROVOD_RUNNER

    release = tmp_path / "release"
    with connect_session(connect_standalone) as spark:
        holder = ConnectSession.builder.remote(connect_standalone).create()  # another user's session
        held = threading.Thread(
            target=lambda: (
                holder.range(2, numPartitions=2).mapInArrow(hold_slots_until(str(release)), "id long").collect()
            )
        )
        try:
            held.start()
            ui, why = server_ui(session_conf(spark))
            assert ui, why
            deadline = time.monotonic() + 120
            while executor_slots(ui, spark.conf.get("spark.app.id"))[1] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)  # its tasks start: both slots held
            started = time.monotonic()
            with pytest.raises(LaunchError) as caught:
                HorovodRunner(np=2, slot_wait_timeout=3).run(allreduce_sum)
            waited = time.monotonic() - started
            text = str(caught.value)
            assert re.search(r"waited \ds for 2 free Spark task slots over Spark Connect sc://\S+ \(spark://", text), (
                text
            )
            assert "the application has 2, 2 of them busy with its other jobs" in text and "slot_wait_timeout" in text
            assert waited < 60, waited  # not the ranks' start timeout (120 s)
            # a submitted run's host waits so for its ranks' slots, one of the busy ones its own (here the holder's)
            in_host = ConnectApp(spark, "", HOROVOD_RUNNER, run_host_slots=1)
            with pytest.raises(LaunchError) as caught:
                in_host.check_slots(1, 2, lambda: False)
            assert (
                re.search(r"waited \d+s for 1 free Spark task slots over Spark Connect", str(caught.value))
                and "the application has 2, 2 of them busy: 1 with this run's own host and 1 with its other jobs"
                in str(caught.value)
                and "This run's host holds 1 of them for the whole run, beside its ranks'." in str(caught.value)
            ), caught.value

            outcome: list = []
            runner = threading.Thread(target=lambda: outcome.append(HorovodRunner(np=2).run(allreduce_sum)))
            runner.start()
            while not any("waiting for 2 free Spark task slots" in r.getMessage() for r in runner_log.records):
                assert runner.is_alive(), outcome
                time.sleep(0.2)
        finally:
            release.touch()
            held.join(60)
            holder.stop()
        runner.join(180)
        assert outcome and outcome[0]["sum"] == 3.0, outcome


def test_an_address_the_driver_cannot_listen_on_names_the_connect_setting(connect_spark):
    """Over Spark Connect spark.driver.* are the server's (a hook refuses them): the error names the settings that
    apply."""
    connect_spark.conf.set(CONNECT_BIND_CONF, "203.0.113.7")  # not an address of this host (TEST-NET-3)
    with pytest.raises(LaunchError) as caught:
        HorovodRunner(np=2).run(allreduce_sum)
    text = str(caught.value)
    assert text.startswith("HorovodRunner cannot listen for its driver channel on 203.0.113.7:0"), text
    assert f"Listen on an address of this host ({CONNECT_BIND_CONF}, or {CONNECT_HOST_CONF} for the address" in text
    assert "spark.driver.bindAddress" not in text


# last: its classic SparkContext (spark_local) stays until the module ends, and a thread without a Connect
# session of its own would run on it
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
