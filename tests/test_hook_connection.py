"""The ``spark`` connection → Spark master rules (those of the apache-spark provider's SparkSubmitHook)."""

from __future__ import annotations

import json
import time
import traceback

import pytest
from airflow.sdk import Connection
from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.sdk.log import redact

from airflow_provider_hvd import LaunchError
from airflow_provider_hvd.hooks.horovod import HorovodHook, masked, master_from_connection


def conn(**fields) -> Connection:
    return Connection(conn_id="spark_test", **{"conn_type": "spark", **fields})


# Connections as users write them: the form's fields, URIs, extras. The expected master URL (and queue and
# namespace) of each is the apache-spark provider's own resolution of the same connection.
CONNECTIONS = {
    "local": {"conn_type": "spark", "host": "local[*]"},
    "local_n": {"conn_type": "spark", "host": "local[2]"},
    "yarn": {"conn_type": "spark", "host": "yarn", "extra": {"queue": "training"}},
    "standalone_url": {"conn_type": "spark", "host": "spark://spark-master:7077"},
    "standalone_fields": {"conn_type": "spark", "host": "spark-master", "port": 7077},
    "scheme_in_host_port_in_field": {"conn_type": "spark", "host": "spark://127.0.0.1", "port": 7077},
    "ha_masters": {"conn_type": "spark", "host": "spark://m1:7077,m2:7077"},
    "k8s_url": {"conn_type": "spark", "host": "k8s://https://k8s.example.com:6443", "extra": {"namespace": "ml"}},
    "k8s_port_in_field": {"conn_type": "spark", "host": "k8s://https://k8s.example.com", "port": 6443},
    "k8s_conn_type": {"conn_type": "k8s", "host": "https://k8s.example.com", "port": 6443},
    "uri_standalone": "spark://spark-master:7077",
    "uri_yarn": "spark://yarn",
    "uri_local": "spark://local%5B4%5D",
}


@pytest.fixture
def connections(monkeypatch):
    from airflow.providers.apache.spark.hooks import spark_submit

    for conn_id, value in CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value if isinstance(value, str) else json.dumps(value))
    # k8s masters need the cncf.kubernetes provider's client, not installed here
    monkeypatch.setattr(spark_submit, "kube_client", object(), raising=False)


@pytest.mark.parametrize("conn_id", sorted(CONNECTIONS))
def test_master_url_is_the_apache_spark_providers(connections, conn_id):
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    theirs = SparkSubmitHook(conn_id=conn_id)._connection
    master, conf = HorovodHook(conn_id).resolve()
    assert (master, conf.get("spark.yarn.queue"), conf.get("spark.kubernetes.namespace")) == (
        theirs["master"],
        theirs["queue"],
        theirs["namespace"],
    )


def test_the_port_field_is_kept_when_the_host_has_a_scheme(connections):
    assert HorovodHook("scheme_in_host_port_in_field").resolve()[0] == "spark://127.0.0.1:7077"


def test_spark_extras_become_conf_and_others_are_mapped():
    extra = {
        "spark.executor.memory": "4g",
        "spark.executor.instances": 3,
        "queue": "training",
        "namespace": "ml",
        "deploy-mode": "client",
        "spark-binary": "spark-submit",
    }
    _, conf = master_from_connection(conn(host="yarn", extra=json.dumps(extra)))
    assert conf == {
        "spark.executor.memory": "4g",
        "spark.executor.instances": "3",
        "spark.yarn.queue": "training",
        "spark.kubernetes.namespace": "ml",
    }


def test_spark_conf_overrides_the_connection(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"spark.executor.memory": "1g"}}),
    )
    hook = HorovodHook(spark_conf={"spark.executor.memory": "8g", "spark.executor.cores": 2})
    assert hook.resolve() == ("yarn", {"spark.executor.memory": "8g", "spark.executor.cores": "2"})


@pytest.mark.parametrize(
    "fields", [{"host": "sc://connect.example:15002"}, {"conn_type": "sc", "host": "connect.example"}]
)
def test_a_spark_connect_url_in_a_spark_connection_names_the_spark_connect_type(fields):
    with pytest.raises(
        ValueError,
        match=r"points at a Spark Connect server \(sc://connect.example:15002\); a Connect server belongs in a "
        r"connection of type 'spark_connect', e.g. `airflow connections add spark_test --conn-type spark_connect",
    ):
        master_from_connection(conn(port=15002, **fields) if "conn_type" in fields else conn(**fields))


def test_cluster_deploy_mode_is_refused():
    with pytest.raises(ValueError, match="deploy-mode 'cluster'"):
        master_from_connection(conn(host="yarn", extra=json.dumps({"deploy-mode": "cluster"})))


def test_missing_connection_says_how_to_define_it(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_TRAINING_CLUSTER", raising=False)
    with pytest.raises(
        AirflowNotFoundException, match="'training_cluster' is not defined.*AIRFLOW_CONN_TRAINING_CLUSTER="
    ):
        HorovodHook("training_cluster").resolve()


def test_a_missing_connection_names_the_runner_that_needs_it(monkeypatch):
    from airflow_provider_hvd import TorchDistributor

    monkeypatch.delenv("AIRFLOW_CONN_TRAINING_CLUSTER", raising=False)
    runner = TorchDistributor(2, local_mode=False, use_gpu=False)
    with pytest.raises(AirflowNotFoundException, match="Define it with the master TorchDistributor should use") as no:
        HorovodHook("training_cluster").run_job(runner, lambda: None, local=False)
    assert "Horovod" not in str(no.value), no.value


@pytest.mark.parametrize(
    ("connection", "message"),
    [
        (
            {"host": "spark://127.0.0.1"},
            r"Connection 'spark_test' gives the Spark master URL 'spark://127.0.0.1', "
            r"which Spark cannot use: .* needs a host and a port",
        ),
        (
            {"host": "spark://127.0.0.1", "port": 1},
            r"Nothing listens at the Spark master spark://127.0.0.1:1 of "
            r"connection 'spark_test'",
        ),
        (
            {"host": "no-such-master"},
            r"Could not start a Spark session on no-such-master \(connection 'spark_test'\): "
            # spark-submit's words when it starts the JVM, SparkContext's in a running one
            r"(the Spark driver's JVM exited: )?"
            r"(Master must either be yarn or start with "
            r"spark, k8s, or local|Could not parse Master URL: 'no-such-master')$",
        ),
    ],
)
def test_a_spark_session_that_cannot_start_names_the_connection_and_master(monkeypatch, connection, message):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", json.dumps({"conn_type": "spark", **connection}))
    with pytest.raises(LaunchError, match=message) as failure:
        HorovodHook("spark_test").run(print, np=2)
    shown = "".join(traceback.format_exception(failure.value))  # what the task log shows
    assert "\tat " not in shown and "Py4J" not in shown and shown.count("Error: ") == 1, shown


def hold_a_rank(seconds: float) -> float:
    import time

    import horovod.torch as hvd

    hvd.init()
    time.sleep(seconds)
    return seconds


def test_two_jobs_at_once_share_the_hooks_spark_session(monkeypatch):
    """Notebooks and services run hooks in threads: the first job to end must not stop the other's Spark."""
    import threading

    from pyspark import SparkContext

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SHARED", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    results: dict[float, object] = {}

    def run(seconds: float) -> None:
        try:
            results[seconds] = HorovodHook("spark_shared").run(hold_a_rank, kwargs={"seconds": seconds}, np=1)
        except Exception as exc:  # noqa: BLE001
            results[seconds] = exc

    first = threading.Thread(target=run, args=(4.0,))  # starts the session, and ends first
    first.start()
    deadline = time.monotonic() + 60
    while SparkContext._active_spark_context is None and time.monotonic() < deadline:
        time.sleep(0.1)
    second = threading.Thread(target=run, args=(12.0,))
    second.start()
    for thread in (first, second):
        thread.join(120)
    assert results == {4.0: 4.0, 12.0: 12.0}
    assert SparkContext._active_spark_context is None  # the last one out stopped it


def test_a_job_cancelled_while_its_session_starts_does_not_run(monkeypatch):
    """on_kill() can come before the ranks start (Airflow calls it on SIGTERM at any time)."""
    from pyspark import SparkContext

    from airflow_provider_hvd import RunCancelledError

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SHARED", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    hook = HorovodHook("spark_shared")
    joined = hook._join_session

    def join_then_get_cancelled():
        session = joined()
        hook.cancel()  # as if SIGTERM arrived while the SparkSession was starting
        return session

    monkeypatch.setattr(hook, "_join_session", join_then_get_cancelled)
    with pytest.raises(RunCancelledError, match="cancelled before its ranks started"):
        hook.run(hold_a_rank, kwargs={"seconds": 60.0}, np=1)
    assert SparkContext._active_spark_context is None


def test_extras_that_are_neither_spark_settings_nor_known_are_refused_by_name():
    extra = {"executor_memory": "4g", "queue": "training", "sparkconf": {"a": 1}, "spark.executor.cores": 2}
    with pytest.raises(ValueError, match=r"Connection 'spark_test' has extras .*: 'executor_memory', 'sparkconf'\. "):
        master_from_connection(conn(host="yarn", extra=json.dumps(extra)))


def test_kerberos_principal_and_keytab_are_the_apache_spark_providers(monkeypatch):
    """The provider passes --principal and --keytab (the extra holds the keytab in base64) to spark-submit;
    the SparkConf settings they stand for are spark.kerberos.principal and spark.kerberos.keytab."""
    import base64
    import os
    import stat
    from pathlib import Path

    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    keytab = b"\x05\x02\x00\x00\x00\x3c a made-up keytab"
    extra = {"principal": "etl@EXAMPLE.COM", "keytab": base64.b64encode(keytab).decode()}
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_KERBEROS", json.dumps({"conn_type": "spark", "host": "yarn", "extra": extra})
    )
    from airflow_provider_hvd.hooks.keytab import remove_keytab

    theirs, conf = SparkSubmitHook(conn_id="spark_kerberos")._connection, {}
    try:
        _, conf = HorovodHook("spark_kerberos").resolve()
        assert conf["spark.kerberos.principal"] == theirs["principal"] == "etl@EXAMPLE.COM"
        assert Path(conf["spark.kerberos.keytab"]).read_bytes() == Path(theirs["keytab"]).read_bytes() == keytab
        assert stat.S_IMODE(os.stat(conf["spark.kerberos.keytab"]).st_mode) == 0o600
    finally:
        Path(theirs["keytab"]).unlink(missing_ok=True)
        remove_keytab(conf)  # (no session took ours)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_KERBEROS",
        json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"keytab": "no base64!"}}),
    )
    with pytest.raises(ValueError, match="keytab extra that is not base64"):
        HorovodHook("spark_kerberos").resolve()


def test_secret_settings_are_masked_where_the_hook_logs_them():
    from airflow_provider_hvd.hooks.horovod import masked

    conf = {
        "spark.executor.memory": "4g",
        "spark.authenticate.secret": "s3",
        "spark.ssl.keyStorePassword": "pw",
        "spark.hadoop.fs.s3a.access.token": "t",
        "spark.kerberos.keytab": "/tmp/k",
    }
    assert masked(conf) == {
        "spark.executor.memory": "4g",
        "spark.authenticate.secret": "***",
        "spark.ssl.keyStorePassword": "***",
        "spark.hadoop.fs.s3a.access.token": "***",
        "spark.kerberos.keytab": "***",
    }


#: storage credentials as Hadoop's connectors name them (Azure's account keys and SAS tokens, S3's secret key and
#: session token, a signature), none of which the hook may log
STORAGE_SECRETS = {
    "spark.hadoop.fs.azure.account.key.acct1.dfs.core.windows.net": "azure-acc0unt-key==",
    "spark.hadoop.fs.azure.account.key.acct1.blob.core.windows.net": "azure-b1ob-key==",
    "spark.hadoop.fs.azure.sas.logs.acct1.blob.core.windows.net": "sv=2024&sig=sas-t0ken",
    "spark.hadoop.fs.azure.sas.fixed.token.acct1.dfs.core.windows.net": "sv=2024&sig=f1xed-sas",
    "spark.hadoop.fs.s3a.secret.key": "s3-secr3t-key",
    "spark.hadoop.fs.s3a.session.token": "s3-sess1on-token",
    "spark.hadoop.fs.s3a.bucket.logs.secret.key": "bucket-secr3t-key",
    "spark.hadoop.fs.cosn.userinfo.signature": "cos-s1gnature",
    "spark.hadoop.fs.azure.account.oauth2.client.secret": "oauth-cl1ent-secret",
}
#: their neighbours that are no secret, shown as they are
STORAGE_SETTINGS = {
    "spark.hadoop.fs.azure.account.auth.type": "SharedKey",
    "spark.hadoop.fs.azure.account.keyprovider.acct1.dfs.core.windows.net": "org.example.KeyProvider",
    "spark.hadoop.fs.s3a.access.key": "AKIAEXAMPLE",
    "spark.hadoop.fs.s3a.endpoint": "https://s3.example.com",
}


def test_storage_credentials_are_masked_in_the_hooks_lines_and_the_task_log(monkeypatch):
    """Before: Azure's account keys and SAS tokens and a signature were logged as they are in the "Starting a
    Spark session ... with {...}" line (and so in the task log)."""
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    _, conf = HorovodHook("spark_test", spark_conf={**STORAGE_SECRETS, **STORAGE_SETTINGS}).resolve()
    shown = masked(conf)
    assert {key: shown[key] for key in STORAGE_SECRETS} == dict.fromkeys(STORAGE_SECRETS, "***")
    assert {key: shown[key] for key in STORAGE_SETTINGS} == STORAGE_SETTINGS
    line = redact(f"Starting a Spark session on local[2] with {conf}")
    assert not [value for value in STORAGE_SECRETS.values() if value in line], line


def test_the_operators_conn_id_is_templated():
    from airflow.sdk import DAG

    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator

    with DAG("templated_conn", schedule=None):
        op = HorovodRunnerOperator(task_id="train", python_callable=print, np=2, conn_id="{{ params.cluster }}")
    op.render_template_fields(context={"params": {"cluster": "spark_prod"}})  # type: ignore[arg-type]
    assert op.conn_id == "spark_prod"
