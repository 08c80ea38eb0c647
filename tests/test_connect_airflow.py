"""Real Airflow (dag.test() on SQLite) on a real Spark Connect server: a task whose connection is a
``spark_connect`` one runs its ranks on the server, in a session of its own, released afterwards, and links the
server's Spark UI. (The real deployment's task on ``connect_local``, whose UI is off: test_airflow_deployment.py.)"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from urllib.parse import urlparse

import pytest
from dag_runs import states, xcom
from rank_lines import tagged_lines

pytestmark = pytest.mark.usefixtures("airflow_db")


@pytest.fixture(scope="module")
def connect_with_ui(tmp_path_factory):
    """A Spark Connect server on ``local[3]`` whose application has its UI on (``connect_local``'s is off): 2 ranks
    and the host of a run that outlives its task (durable, the default on Spark Connect)."""
    from connect_server import ConnectServer

    server = ConnectServer(tmp_path_factory.mktemp("spark-connect-ui"), "local[3]", **{"spark.ui.enabled": "true"})
    yield server.start()
    server.stop()


def sessions(server) -> tuple[set[str], set[str]]:
    """The ids of the sessions the server's log says were used, and of those it closed."""
    text = server.log_file.read_text(errors="replace")
    used = set(re.findall(r"Session with userId: \S* and sessionId: ([\w-]+) accessed", text))
    return used, set(re.findall(r"Closing session with userId: \S* and sessionId: ([\w-]+)", text))


@pytest.fixture
def spark_connect_default(connect_with_ui, monkeypatch, caplog):
    """``spark_connect_default`` on the server, as the connection form invites (scheme in Host, the port in its
    own field); the provider's log lines captured."""
    import logging

    server = urlparse(connect_with_ui.url)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT",
        json.dumps({"conn_type": "spark_connect", "host": f"sc://{server.hostname}", "port": server.port}),
    )
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    return f"{server.hostname}:{server.port}"


def test_an_operator_on_a_spark_connect_connection_runs_over_the_server(
    dags, connect_with_ui, spark_connect_default, caplog, capsys
):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    run = dags["hvd_on_spark_connect"].test()
    task_log = capsys.readouterr().out
    assert states(run) == {"allreduce": "success"}, task_log[-3000:]
    assert xcom(run, "allreduce") == {"size": 2, "sum": 3.0}
    assert set(tagged_lines(caplog.records)) == {"[rank 0] rank 0 of 2 sums 3.0", "[rank 1] rank 1 of 2 sums 3.0"}
    assert (
        f"Opening a session on the Spark Connect server sc://{spark_connect_default}, connection "
        "'spark_connect_default' of type spark_connect" in task_log
    )
    ran_over = re.search(
        rf"Running over Spark Connect at {spark_connect_default}: application (local-\d+), Spark UI (\S+)", task_log
    )
    assert ran_over, task_log[-3000:]
    app_id, link = ran_over.groups()
    # the server's own UI, which outlives the task: the port (from 4040 on) that lists the server's application
    assert re.fullmatch(r"http://localhost:\d+/jobs/", link) and xcom(run, "allreduce", "_link_SparkUILink") == link
    with urllib.request.urlopen(link.replace("/jobs/", "/api/v1/applications"), timeout=10) as resp:
        assert [app["id"] for app in json.load(resp)] == [app_id]
    assert ConnectSession.getActiveSession() is None and ConnectSession._default_session is None
    # durable: the task submitted the run, which outlives the task's process, and attached to it
    assert "Submitted the run: {" in task_log, task_log[-3000:]
    # the server closes every session: the task's (spark.stop() released it), and the run's and its ranks' once
    # the run's host has handed over its outcome (it does so as the task ends)
    deadline = time.monotonic() + 30
    while (found := sessions(connect_with_ui))[1] != found[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    used, closed = found
    assert len(used) == 3 and closed == used, (used, closed)


def test_a_torch_distributed_decorator_on_a_spark_connect_connection_runs_over_the_server(
    dags, spark_connect_default, capsys
):
    run = dags["torch_on_spark_connect"].test()
    task_log = capsys.readouterr().out
    assert states(run) == {"gather_ranks": "success"}, task_log[-3000:]
    assert xcom(run, "gather_ranks") == [0, 1]
    assert f"Running over Spark Connect at {spark_connect_default}: application local-" in task_log


def test_spark_conf_on_spark_connect_applies_what_a_session_may_set_and_names_the_servers(
    spark_connect_default, capsys
):
    from airflow_provider_hvd import LaunchError
    from airflow_provider_hvd.hooks.horovod import HorovodHook

    asked = {"spark.sql.shuffle.partitions": "3", "spark.executor.memory": "3g"}
    spark = HorovodHook("spark_connect_default", spark_conf=asked).get_conn()
    try:
        assert spark.conf.get("spark.sql.shuffle.partitions") == "3"
    finally:
        spark.stop()
    assert (
        "These settings of connection 'spark_connect_default' and spark_conf are the Spark Connect server's and do "
        "not apply (set them where the server starts: start-connect-server.sh --conf KEY=VALUE): "
        "spark.executor.memory=3g (server: unset)" in capsys.readouterr().out
    )
    hook = HorovodHook("spark_connect_default", spark_conf={"spark.task.cpus": "2", "spark.driver.host": "10.0.0.9"})
    with pytest.raises(
        LaunchError,
        match=r"^These settings of connection 'spark_connect_default' and spark_conf are the Spark Connect server's, "
        r"which has them otherwise; a session cannot set them: spark.driver.host=10.0.0.9 \(server: [^)]+\), "
        r"spark.task.cpus=2 \(server: unset\)\. Set them where the server starts .* The address the ranks reach "
        r"this task at is spark.horovodRunner.driverHost",
    ):
        hook.run(print, np=2)


def rank_server_log_dir() -> str | None:
    """The log folder of the Connect server whose executor runs the rank (tests/connect_server.py gives each
    server its own; a rank inherits it from the server's JVM); None on a classic session."""
    import os

    return os.environ.get("SPARK_LOG_DIR")


def runner_said(caplog, capsys) -> str:
    """The runner's lines, wherever logging sent them (Airflow's configuration, once loaded, prints them)."""
    return capsys.readouterr().out + "\n".join(record.getMessage() for record in caplog.records)


def test_a_hook_runs_its_job_on_its_own_server_in_a_thread_that_holds_another_session(
    connect_local, connect_with_ui, spark_connect_default, caplog, capsys
):
    """pyspark makes a new Connect session the thread's active one only where none is: a notebook's, or a
    task's own session to another server, must not take the hook's job."""
    from connect_server import connect_session
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.hooks.horovod import HorovodHook

    with connect_session(connect_local) as other:
        assert ConnectSession.getActiveSession() is other
        ran_in = HorovodHook("spark_connect_default").run(rank_server_log_dir, np=2)
        assert ConnectSession.getActiveSession() is other  # the thread's own session is left as it was
    assert ran_in == str(connect_with_ui.workdir)
    said = runner_said(caplog, capsys)
    assert f"a Spark barrier job of 2 tasks over Spark Connect sc://{spark_connect_default} (local[3])" in said


def test_a_classic_connection_runs_on_its_spark_context_in_a_thread_that_holds_a_connect_session(
    connect_local, spark_default_local, caplog, capsys
):
    from connect_server import connect_session

    from airflow_provider_hvd.hooks.horovod import HorovodHook

    with connect_session(connect_local):
        ran_in = HorovodHook("spark_default").run(rank_server_log_dir, np=2)
    assert ran_in is None
    said = runner_said(caplog, capsys)
    assert "a Spark barrier job of 2 tasks on local[2]" in said and "over Spark Connect" not in said


def test_the_durable_example_trains_in_a_run_that_outlives_its_task(dags, spark_connect_default, caplog, capsys):
    """dags/torch_durable_example.py: DDP over the server, submitted (durable, the default on Spark Connect),
    its id in the task state store, rank 0's metrics the XCom."""
    run = dags["torch_durable_example"].test()
    task_log = capsys.readouterr().out
    assert states(run) == {"train": "success", "report": "success"}, task_log[-3000:]
    assert xcom(run, "train")["ranks"] == 2 and xcom(run, "train")["accuracy"] >= 0.8
    submitted = re.search(r"Submitted the run: (\{.*?\}) \(a retry", task_log)
    assert submitted, task_log[-3000:]
    assert any(line.startswith("[rank 0] epoch 6/6: loss=") for line in tagged_lines(caplog.records))


def test_a_task_whose_ranks_fit_the_server_and_its_host_does_not_runs_in_its_process_with_one_warning(
    dags, connect_local, monkeypatch, caplog, capsys
):
    """@task.horovod(np=2) on a Connect server of 2 task slots ran before runs outlived their task, and runs so
    still: in the task's process, not durably (the run's host would need a third slot), with one warning that
    says why and what gives durability."""
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT", connect_local.replace("sc://", "spark-connect://"))
    run = dags["hvd_task_on_a_server_of_np_slots"].test()  # (tests/dags/hvd_connect_dags.py)
    task_log = capsys.readouterr().out
    assert states(run) == {"sum_over_connect": "success"}, task_log[-3000:]
    assert xcom(run, "sum_over_connect") == {"size": 2, "sum": 3.0}
    assert set(tagged_lines(caplog.records)) == {"[rank 0] rank 0 of 2 sums 3.0", "[rank 1] rank 1 of 2 sums 3.0"}
    warnings = [line for line in task_log.splitlines() if "not durably" in line]
    assert len(warnings) == 1, task_log[-3000:]
    assert (
        "Task 'sum_over_connect' runs in the task's process, not durably: HorovodRunner(np=2)'s 2 ranks fit the "
        "cluster at local[2] (2 Spark task slots at most), but a submitted run needs 1 more for its host, which "
        "holds it for the whole run: 3 at once. A run that outlives the task needs one more task slot on the "
        "server; durable=False runs it in the task's process without this warning." in warnings[0]
    ), warnings
    assert "Submitted the run" not in task_log and "LaunchError" not in task_log, task_log[-3000:]


def test_deferrable_on_a_classic_connection_is_refused_in_one_sentence(dags, spark_default_local, capsys):
    run = dags["deferrable_on_classic"].test()  # (tests/dags/hvd_durable_dags.py)
    assert states(run) == {"train": "failed"}
    assert (
        "Task 'train': deferrable=True needs a run that outlives the task, and connection 'spark_default' is a "
        "classic Spark one, whose run has its driver in the task's process (client mode): use a spark_connect "
        "connection, or deferrable=False." in capsys.readouterr().out
    )


def test_a_dataframe_callable_over_spark_connect_trains_on_its_rows_in_a_run_that_outlives_its_task(
    dags, spark_connect_default, caplog, capsys
):
    """dataframe= on a spark_connect connection: durable as any run there, the task submits it with the callable
    (pickled by value from the DAG file), and the run's host builds the DataFrame in its own session and shares
    its rows out among the ranks."""
    run = dags["hvd_dataframe_over_connect"].test()  # (tests/dags/dataframe_test_dags.py)
    task_log = capsys.readouterr().out
    assert states(run) == {"sum_squares": "success"}, task_log[-3000:]
    assert xcom(run, "sum_squares") == {"rank": 0, "rows": 10, "total": 2 * 285, "shard_rows": 5}
    assert "Submitted the run: {" in task_log, task_log[-3000:]
    assert "not durably" not in task_log, task_log[-3000:]
    said = task_log + caplog.text  # (the host's lines, relayed to the task's loggers)
    assert "building the run's DataFrame from the callable squares in the run's host" in said, said[-3000:]


def test_a_trigger_run_again_after_its_triggerer_stopped_attaches_to_the_same_run(
    spark_connect_default, connect_with_ui, tmp_path
):
    """A triggerer that stops cancels its triggers (their ``cleanup()`` detaches); the triggerer that takes the
    deferred task over makes the trigger again from ``serialize()`` and runs it: it attaches to the same run
    (same ranks, no second start), fires once the run ended, and leaves rank 0's value for the task."""
    import asyncio
    import importlib

    from connect_server import connect_session
    from jobs import alive, train_until_gate, wait_for_pids

    from airflow_provider_hvd import HorovodRunner, attach
    from airflow_provider_hvd.triggers.training_job import TrainingJobTrigger

    pid_dir, gate = tmp_path / "pids", tmp_path / "gate"
    pid_dir.mkdir()
    with connect_session(connect_with_ui.url):
        job = HorovodRunner(np=2).submit(train_until_gate, pid_dir=str(pid_dir), gate=str(gate))
        job.close()  # (the task detaches before it defers)
    try:
        pids = wait_for_pids(str(pid_dir), 2, timeout=180)
        first = TrainingJobTrigger(job.id, "spark_connect_default")

        async def stopped_triggerer() -> None:
            watching = asyncio.ensure_future(first.run().__anext__())
            while first._job is None or first._job.status().phase != "running":  # attached, the ranks training
                assert not watching.done(), watching.result()
                await asyncio.sleep(0.2)
            watching.cancel()  # what a triggerer that stops does to its triggers, then their cleanup()
            await first.cleanup()

        asyncio.run(stopped_triggerer())
        assert all(alive(pid) for pid in pids), "a rank ended with the stopped triggerer"
        path, kwargs = first.serialize()
        module, name = path.rsplit(".", 1)
        again = getattr(importlib.import_module(module), name)(**kwargs)

        async def next_triggerer() -> dict:
            watching = asyncio.ensure_future(again.run().__anext__())
            while again._job is None and not watching.done():
                await asyncio.sleep(0.2)
            gate.touch()
            return (await asyncio.wait_for(watching, 120)).payload

        assert asyncio.run(next_triggerer()) == {"job_id": job.id, "outcome": "succeeded", "cause": None}
        with attach(job.id, logs=False) as task:  # the task, resumed on a worker
            assert task.wait(60)["pid"] == pids[0]
        for rank in (0, 1):  # the same ranks throughout
            assert (pid_dir / f"rank-{rank}.pids").read_text().split() == [str(pids[rank])]
    finally:
        gate.touch()
