"""The ``spark`` connection → Spark master rules (those of the apache-spark provider's SparkSubmitHook)."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_hvd.hooks.horovod import HorovodHook, master_from_connection


def conn(**fields) -> Connection:
    return Connection(conn_id="spark_test", **{"conn_type": "spark", **fields})


@pytest.mark.parametrize(
    ("connection", "master"),
    [
        (conn(host="local[*]"), "local[*]"),
        (conn(host="local[2]"), "local[2]"),
        (conn(host="yarn"), "yarn"),
        (conn(host="spark://spark-master:7077"), "spark://spark-master:7077"),
        (conn(host="k8s://https://k8s.example.com:6443"), "k8s://https://k8s.example.com:6443"),
        (conn(host="spark-master", port=7077), "spark://spark-master:7077"),
        (Connection.from_uri("spark://spark-master:7077", conn_id="u"), "spark://spark-master:7077"),
        (Connection.from_uri("spark://yarn", conn_id="u"), "yarn"),
        (Connection(conn_id="u", conn_type="k8s", host="https://k8s.example.com", port=6443), "k8s://https://k8s.example.com:6443"),
    ],
)
def test_master_url(connection, master):
    assert master_from_connection(connection)[0] == master


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


def test_spark_connect_is_refused():
    with pytest.raises(ValueError, match="Spark Connect .* needs a classic SparkContext"):
        master_from_connection(conn(host="sc://connect.example:15002"))


def test_cluster_deploy_mode_is_refused():
    with pytest.raises(ValueError, match="deploy-mode 'cluster'"):
        master_from_connection(conn(host="yarn", extra=json.dumps({"deploy-mode": "cluster"})))


def test_missing_connection_says_how_to_define_it(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_TRAINING_CLUSTER", raising=False)
    with pytest.raises(AirflowNotFoundException, match="'training_cluster' is not defined.*AIRFLOW_CONN_TRAINING_CLUSTER="):
        HorovodHook("training_cluster").resolve()
