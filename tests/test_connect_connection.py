"""The ``spark_connect`` connection → Spark Connect URL rules (those of the apache-spark provider's SparkConnectHook),
its bad input, and a server that cannot be reached: no server needed."""

from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlparse

import pytest

from airflow_provider_hvd import LaunchError
from airflow_provider_hvd.hooks.horovod import HorovodHook

# Connections as users write them: the form's fields, URIs, extras. The expected URL of each is the provider's.
CONNECTIONS = {
    "host_only": {"conn_type": "spark_connect", "host": "connect-server"},
    "host_and_port": {"conn_type": "spark_connect", "host": "connect-server", "port": 15012},
    "scheme_in_host": {"conn_type": "spark_connect", "host": "sc://connect-server", "port": 15012},
    "user_and_token": {
        "conn_type": "spark_connect",
        "host": "connect-server",
        "port": 443,
        "login": "etl",
        "password": "t0k=en;x",
        "extra": {"use_ssl": True},
    },
    "uri": "spark-connect://etl:secret@connect-server:15002?use_ssl=false",
    "use_ssl_1": {"conn_type": "spark_connect", "host": "connect-server", "extra": {"use_ssl": "1"}},
    # hosts whose names begin as a classic master's (local, yarn): a server on this host, a gateway
    "localhost_uri": "spark-connect://localhost:15002",
    "localhost": {"conn_type": "spark_connect", "host": "localhost"},
    "yarn_gateway": {"conn_type": "spark_connect", "host": "yarn-gateway", "port": 15012},
}
# the URL each connection stands for (the apache-spark provider's SparkConnectHook's rules), and whether the
# channel is TLS: pyspark's ChannelBuilder takes use_ssl only as "true", and a token always goes over TLS
EXPECTED = {
    "host_only": ("sc://connect-server/", False),
    "host_and_port": ("sc://connect-server:15012/", False),
    "scheme_in_host": ("sc://connect-server:15012/", False),
    "user_and_token": ("sc://connect-server:443/;user_id=etl;token=t0k%3Den%3Bx;use_ssl=True", True),
    "uri": ("sc://connect-server:15002/;user_id=etl;token=secret;use_ssl=false", True),
    "use_ssl_1": ("sc://connect-server/;use_ssl=1", False),
    "localhost_uri": ("sc://localhost:15002/", False),
    "localhost": ("sc://localhost/", False),
    "yarn_gateway": ("sc://yarn-gateway:15012/", False),
}


@pytest.fixture
def connections(monkeypatch):
    for conn_id, value in CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value if isinstance(value, str) else json.dumps(value))


@pytest.mark.parametrize("conn_id", sorted(CONNECTIONS))
def test_the_url_is_the_apache_spark_providers(connections, conn_id):
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    url, tls = EXPECTED[conn_id]
    target = HorovodHook(conn_id).connect_target()
    assert target is not None and target.url == url
    assert target.address == f"{urlparse(url).hostname}:{target.port}" and target.port in (15002, 15012, 443)
    assert target.tls is tls is DefaultChannelBuilder(url).secure  # what the task log says is what pyspark does
    assert ("TLS" in target.describe()) is tls


def test_a_token_spark_connect_cannot_read_is_refused_by_name(monkeypatch):
    """The provider's URL keeps a '/' of the token, which pyspark then refuses as a path, token in its words."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_CONNECT_TEST",
        json.dumps({"conn_type": "spark_connect", "host": "connect-server", "password": "t0k/en"}),
    )
    with pytest.raises(ValueError, match=r"^Connection 'connect_test' \(spark_connect\): Spark Connect cannot") as exc:
        HorovodHook("connect_test").connect_target()
    assert "t0k" not in str(exc.value)


def test_the_task_log_names_the_type_and_server_never_the_token(connections):
    from airflow.sdk.log import redact

    target = HorovodHook("user_and_token").connect_target()
    assert target is not None
    described = target.describe()
    assert described == (
        "Spark Connect server sc://connect-server:443 (user_id etl, token ***, TLS), connection 'user_and_token' "
        "of type spark_connect"
    )
    assert "token=t0k" in target.url and redact(target.url) == target.url.replace("t0k%3Den%3Bx", "***")
    assert redact("the token t0k=en;x") == "the token ***"


def test_a_spark_connection_is_not_a_connect_one(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    assert HorovodHook("spark_test").connect_target() is None


@pytest.mark.parametrize(
    "host", ["spark://spark-master:7077", "yarn", "local", "local[*]", "local[2,3]", "k8s://https://k8s:6443"]
)
def test_a_classic_master_in_a_spark_connect_connection_names_the_spark_type(monkeypatch, host):
    monkeypatch.setenv("AIRFLOW_CONN_CONNECT_TEST", json.dumps({"conn_type": "spark_connect", "host": host}))
    with pytest.raises(
        ValueError,
        match=rf"'connect_test' is of type spark_connect but its host '{re.escape(host)}' is a classic Spark "
        r"master; .* "
        r"belongs in a connection of type 'spark', e.g. `airflow connections add connect_test --conn-type spark ",
    ):
        HorovodHook("connect_test").run(print, np=2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"'connect_test' of type spark_connect has no host: give the Spark Connect server's host"),
        ({"host": "connect-server/db"}, r"has a path in its host 'connect-server/db'; .* sc://host:port, with no path"),
        (
            {"host": "connect-server", "extra": {"use_ssl": True, "queue": "q", "spark.sql.shuffle.partitions": 4}},
            r"'connect_test' \(spark_connect\) has extras .*: 'queue'\. Known: history-server-url, use_ssl",
        ),
    ],
)
def test_bad_spark_connect_connections_are_refused_by_name(monkeypatch, fields, message):
    monkeypatch.setenv("AIRFLOW_CONN_CONNECT_TEST", json.dumps({"conn_type": "spark_connect", **fields}))
    with pytest.raises(ValueError, match=message):
        HorovodHook("connect_test").connect_target()


@pytest.fixture
def silent_port():
    """A loopback port whose listener never accepts and whose backlog is full: a connection to it hangs, as to a
    server behind a firewall that drops packets."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    waiting = []
    for _ in range(3):  # fill the backlog: the next SYNs are dropped
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        waiting.append(client)
    yield port
    for client in waiting:
        client.close()
    listener.close()


@pytest.mark.parametrize("silent", [True, False], ids=["no-answer", "refused"])
def test_a_server_that_cannot_be_reached_is_named_within_seconds(monkeypatch, silent_port, silent):
    """pyspark alone waits on gRPC's retries: still waiting after 150 s on both, measured here."""
    if silent:
        port = silent_port
    else:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
    monkeypatch.setenv(
        "AIRFLOW_CONN_CONNECT_TEST", json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": port})
    )
    started = time.monotonic()
    with pytest.raises(
        LaunchError,
        match=rf"^Cannot reach the Spark Connect server at 127.0.0.1:{port} \(connection 'connect_test'\): "
        r".*\. Start the server \(start-connect-server.sh\), or correct the connection's host and port\.$",
    ):
        HorovodHook("connect_test").run(print, np=2)
    assert time.monotonic() - started < 15


def test_openlineage_properties_are_said_not_to_apply_on_spark_connect(monkeypatch, capsys):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv(
        "AIRFLOW_CONN_CONNECT_TEST", json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": port})
    )
    hook = HorovodHook("connect_test", openlineage_conf={"spark.openlineage.parentRunId": "run-1"})
    with pytest.raises(LaunchError, match="Cannot reach the Spark Connect server"):
        hook.run(print, np=2)
    assert "OpenLineage's properties of this job do not apply on Spark Connect" in capsys.readouterr().out


def test_openlineage_http_headers_and_auth_are_secret(monkeypatch):
    """OpenLineage's HTTP transport takes its credentials as transport.headers.* (an Authorization header) or
    transport.auth.*: masked where the hook logs them, and in the whole task log."""
    from airflow.sdk.log import redact

    from airflow_provider_hvd.hooks.horovod import masked

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    lineage = {
        "spark.openlineage.transport.headers.Authorization": "Bearer h3ader-k3y",
        "spark.openlineage.transport.auth.type": "api_key",
        "spark.openlineage.transport.auth.apiKey": "ap1-k3y",
        "spark.openlineage.transport.url": "http://marquez:5000",
    }
    _, conf = HorovodHook("spark_test", openlineage_conf=lineage).resolve()
    assert masked(conf) == {
        "spark.openlineage.transport.headers.Authorization": "***",
        "spark.openlineage.transport.auth.type": "api_key",
        "spark.openlineage.transport.auth.apiKey": "***",
        "spark.openlineage.transport.url": "http://marquez:5000",
    }
    assert redact("sent Bearer h3ader-k3y and ap1-k3y") == "sent *** and ***"


def test_a_session_whose_server_is_gone_is_stopped_within_seconds():
    """The hook stops its session when the job ends, also where the server died meanwhile: pyspark alone retries
    releasing it for ~10 minutes (15 tries, up to 60 s apart; still in spark.stop() after 30 s here)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.hooks.spark_connect import STOP_TIMEOUT_S, stop_session

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    spark = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").create()  # no RPC yet: as if it died since
    started = time.monotonic()
    stop_session(spark)
    assert spark.is_stopped and time.monotonic() - started < STOP_TIMEOUT_S + 5


def test_a_session_is_stopped_on_a_pyspark_without_its_private_deadlines(caplog):
    """Where pyspark lacks the per-call deadlines the release is bounded by, the session still stops (pyspark's
    own deadline then), with a WARNING naming the part."""
    import logging

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.hooks.spark_connect import stop_session

    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    spark = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").create()
    del spark.client._rpc_deadlines  # as a pyspark without them
    stop_session(spark)
    assert spark.is_stopped
    assert "has no SparkConnectClient._rpc_deadlines" in caplog.text
