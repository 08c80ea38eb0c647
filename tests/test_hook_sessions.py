"""HorovodHook's Spark sessions: released whatever fails, set-up errors that keep a bug's traceback, a running
SparkContext joined only where it runs the job as asked, and task logs without noise."""

from __future__ import annotations

import json
import logging
import traceback

import pytest
from conftest import make_session

from airflow_provider_hvd import LaunchError
from airflow_provider_hvd.hooks import horovod as hook_module
from airflow_provider_hvd.hooks.horovod import HorovodHook


@pytest.fixture(autouse=True)
def local_connection(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL2", json.dumps({"conn_type": "spark", "host": "local[2]"}))


@pytest.fixture
def no_session_left():
    """Whatever the test did, no SparkContext and no hook-started JVM outlive it."""
    from pyspark import SparkContext

    yield
    leftover = SparkContext._active_spark_context
    if leftover is not None:
        leftover.stop()
    assert leftover is None, "the test left a SparkContext running"


def ranks() -> int:
    import horovod.torch as hvd

    hvd.init()
    return hvd.size()


def test_a_failure_right_after_joining_the_session_releases_it(monkeypatch, no_session_left):
    """Before: application_ui_url() ran between joining the shared session and the try that leaves it."""
    from pyspark import SparkContext

    from airflow_provider_hvd.hooks.spark_output import stop_gateway

    if SparkContext._gateway is not None:  # a JVM that an earlier module's session left: not the hook's to stop
        stop_gateway(SparkContext._gateway)
    assert SparkContext._gateway is None, "a SparkContext of an earlier test is still running"

    def broken(sc, history_server=None):
        raise RuntimeError("the UI link failed")

    monkeypatch.setattr(hook_module, "application_ui_url", broken)
    with pytest.raises(RuntimeError, match="the UI link failed"):
        HorovodHook("spark_local2").run(ranks, np=1)
    assert SparkContext._active_spark_context is None
    assert SparkContext._gateway is None  # the JVM the hook started is gone too
    from airflow_provider_hvd.hooks.shared_session import shared_session

    assert shared_session.users == 0


def test_a_bug_in_the_session_set_up_keeps_its_traceback(monkeypatch):
    """Before: ``LaunchError(...) from None``: the bug's own traceback was lost."""

    def buggy_gateway(conf):
        return {}["spark.master"]

    monkeypatch.setattr(hook_module, "launch_logged_gateway", buggy_gateway)
    with pytest.raises(LaunchError, match=r"Could not start a Spark session on local\[2\] .*'spark.master'") as failure:
        HorovodHook("spark_local2").run(ranks, np=1)
    assert isinstance(failure.value.__cause__, KeyError)
    assert "in buggy_gateway" in "".join(traceback.format_exception(failure.value))


def test_a_running_spark_context_is_joined_only_where_it_runs_the_job_as_asked(capsys, no_session_left):
    """Before: the connection's extras and spark_conf were dropped without a word."""
    spark = make_session("local[2]", **{"spark.executor.memory": "1g"})
    try:
        with pytest.raises(LaunchError, match=r"differs .* spark.task.resource.gpu.amount=1 \(running: unset\)"):
            HorovodHook("spark_local2", spark_conf={"spark.task.resource.gpu.amount": "1"}).get_conn()
        hook = HorovodHook(
            "spark_local2", spark_conf={"spark.executor.memory": "2g", "spark.authenticate.secret": "hunter2"}
        )
        assert hook.get_conn().sparkContext is spark.sparkContext
        task_log = capsys.readouterr().out  # where the hook's log goes, as in a task
        assert "spark.executor.memory=2g (running: 1g)" in task_log
        assert "spark.authenticate.secret=*** (running: unset)" in task_log  # (whether it is set is no secret)
        assert "hunter2" not in task_log
        # OpenLineage's properties for the task's own session: those of a joined one stay, which is said
        lineage = {"spark.openlineage.parentRunId": "run-1", "spark.openlineage.transport.auth.apiKey": "Bearer k3y"}
        assert HorovodHook("spark_local2", openlineage_conf=lineage).get_conn().sparkContext is spark.sparkContext
        task_log = capsys.readouterr().out
        assert "OpenLineage's properties of this job do not apply" in task_log
        assert "spark.openlineage.parentRunId=run-1 (running: unset)" in task_log
        assert "k3y" not in task_log
    finally:
        spark.stop()


def test_a_hook_run_logs_no_py4j_chatter_no_storage_key_and_no_dash_for_a_ui_it_has_not(
    caplog, capsys, no_session_left
):
    account_key = "spark.hadoop.fs.azure.account.key.acct1.dfs.core.windows.net"
    caplog.set_level(logging.INFO)
    conf = {"spark.ui.enabled": "false", account_key: "azure-acc0unt-key=="}
    assert HorovodHook("spark_local2", spark_conf=conf).run(ranks, np=1) == 1
    assert "Closing down clientserver connection" not in caplog.text  # py4j's lines go through logging
    task_log = capsys.readouterr().out  # where the hook's log goes, as in a task
    started = [line for line in task_log.splitlines() if "Spark master local[2], application " in line]
    assert started and "UI -" not in started[0], started
    assert f"'{account_key}': '***'" in task_log and "azure-acc0unt-key" not in task_log


def keytab_there(path: str) -> bool:
    import os

    return os.path.exists(path)


def test_the_keytab_file_lives_as_long_as_its_session(monkeypatch, no_session_left):
    """Before: the keytab of the connection's extra, written to a temporary file, stayed there for good."""
    import base64
    from pathlib import Path

    from pyspark import SparkContext

    from airflow_provider_hvd.hooks.spark_output import stop_gateway

    if SparkContext._gateway is not None:  # a JVM that an earlier module's session left: not the hook's to stop
        stop_gateway(SparkContext._gateway)
    keytab = base64.b64encode(b"\x05\x02\x00\x00\x00\x3c a made-up keytab").decode()
    connection = {"conn_type": "spark", "host": "local[2]", "extra": {"keytab": keytab}}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_KERBEROS_LOCAL", json.dumps(connection))
    hook = HorovodHook("spark_kerberos_local")
    path = hook.resolve()[1]["spark.kerberos.keytab"]
    assert hook.run(keytab_there, kwargs={"path": path}, np=1) is True  # there while the session runs
    assert not Path(path).exists(), "the keytab outlived its session"

    def buggy_gateway(conf):
        raise RuntimeError("no JVM")

    monkeypatch.setattr(hook_module, "launch_logged_gateway", buggy_gateway)
    with pytest.raises(LaunchError, match="no JVM"):
        HorovodHook("spark_kerberos_local").run(keytab_there, kwargs={"path": path}, np=1)
    assert not Path(path).exists(), "the keytab outlived a session that did not start"
