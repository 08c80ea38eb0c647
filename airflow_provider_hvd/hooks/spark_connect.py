"""The ``spark_connect`` connection (the apache-spark provider's): its URL, what of it may be logged, and the
Spark Connect session a hook opens on it for one job.

Each hook opens a session of its own and releases it after its job (``spark.stop()``), unlike the classic
SparkContext that hooks in one process share (``shared_session``): a Connect server holds any number of
isolated sessions, and one hook's ``stop()`` must not end another's job on the same server. The session is
made with Connect's own builder (``create()``), which neither hands out another thread's session (as
``getOrCreate()`` does) nor switches the whole process to Connect mode (``SPARK_CONNECT_MODE_ENABLED``), so a
classic session can still start in the same process afterwards.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from airflow_provider_hvd.runner.errors import LaunchError, SettingError
from airflow_provider_hvd.runner.spark import bound_release

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from pyspark.sql.connect.session import SparkSession as ConnectSession

CONN_TYPE = "spark_connect"
DEFAULT_PORT = 15002  # pyspark's ChannelBuilder's, for a URL without one
REACH_TIMEOUT_S = 5.0  # a server that does not accept a TCP connection by then is named, not retried by gRPC
STOP_TIMEOUT_S = 5.0  # releasing the session on a server that is gone: not pyspark's 10 minutes of retries
# Spark's own master URLs: a scheme, or one of its words exactly (a server named localhost or yarn-gateway is none)
_CLASSIC_MASTER = re.compile(r"(?:spark|k8s|mesos)://.*|yarn|local(?:\[[^\]]*\])?|local-cluster\[[^\]]*\]")
_EXTRAS = {"use_ssl", "history-server-url"}


def is_connect_url(master: str) -> bool:
    """Whether a master URL is a Spark Connect one (``sc://``)."""
    return master.startswith("sc://")


def is_classic_master(host: str) -> bool:
    """``spark://...``, ``yarn``, ``local``, ``local[...]``, ``k8s://...``: a master of a classic SparkContext (not
    ``localhost``, a host's name)."""
    return _CLASSIC_MASTER.fullmatch(host) is not None


@dataclass(frozen=True)
class ConnectTarget:
    """Where a ``spark_connect`` connection points, and what of it may be logged."""

    conn_id: str
    url: str  #: the full URL, token included: never log it
    host: str
    port: int
    user_id: str | None = None
    has_token: bool = False
    tls: bool = False  #: as pyspark's channel is: ``use_ssl=true``, or a token
    conf: dict[str, str] = field(default_factory=dict)  #: the connection's ``spark.*`` extras
    history_server: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """The connection in words, for the task log: no token."""
        details = [f"user_id {self.user_id}"] if self.user_id else []
        details += ["token ***"] if self.has_token else []
        details += ["TLS"] if self.tls else []
        extra = f" ({', '.join(details)})" if details else ""
        return f"Spark Connect server sc://{self.address}{extra}, connection {self.conn_id!r} of type {CONN_TYPE}"


def connect_target(conn: Connection) -> ConnectTarget:
    """What a ``spark_connect`` connection stands for, read as the provider's ``SparkConnectHook`` reads it:
    host (with or without ``sc://``), port, login → ``user_id``, password → ``token``, extra ``use_ssl``.

    A classic master in it (``spark://``, ``yarn``, ``local[*]``, ``k8s://``) is refused: that is a ``spark``
    connection. Extras other than ``use_ssl``, ``history-server-url`` and Spark settings are refused by name.
    """
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
    from pyspark.errors import PySparkValueError
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    host = (conn.host or "").strip()
    if not host:
        raise SettingError(
            f"Connection {conn.conn_id!r} of type {CONN_TYPE} has no host: give the Spark Connect server's host "
            f"(e.g. connect-server, or sc://connect-server) and its port ({DEFAULT_PORT} by default)."
        )
    if is_classic_master(host):
        raise SettingError(
            f"Connection {conn.conn_id!r} is of type {CONN_TYPE} but its host {host!r} is a classic Spark master; "
            "a master URL (spark://, yarn, local[*], k8s://) belongs in a connection of type 'spark', e.g. "
            f"`airflow connections add {conn.conn_id} --conn-type spark --conn-host {host!r}`."
        )
    extra = conn.extra_dejson
    unknown = sorted(key for key in extra if not key.startswith("spark.") and key not in _EXTRAS)
    if unknown:
        raise SettingError(
            f"Connection {conn.conn_id!r} ({CONN_TYPE}) has extras that are neither Spark settings (spark.*) nor "
            f"ones HorovodHook knows: {', '.join(map(repr, unknown))}. Known: {', '.join(sorted(_EXTRAS))}."
        )

    class _ThisConnection(SparkConnectHook):  # the provider's URL rules, on the connection already read
        def get_connection(self, conn_id: str) -> Connection:  # type: ignore[override]
            return conn

    try:
        url = _ThisConnection(conn.conn_id).get_connection_url()
    except ValueError:
        raise SettingError(
            f"Connection {conn.conn_id!r} ({CONN_TYPE}) has a path in its host {host!r}; Spark Connect's URL is "
            "sc://host:port, with no path."
        ) from None
    parsed = urlparse(url)
    try:
        channel = DefaultChannelBuilder(url)
    except PySparkValueError:  # its words hold the token
        raise SettingError(
            f"Connection {conn.conn_id!r} ({CONN_TYPE}): Spark Connect cannot read the URL its login and password "
            "make (a '/' in them ends up in the URL's path); use a user id and token without '/'."
        ) from None
    return ConnectTarget(
        conn_id=conn.conn_id,
        url=url,
        host=parsed.hostname or host,
        port=parsed.port or DEFAULT_PORT,
        user_id=conn.login or None,
        has_token=bool(conn.password),
        tls=channel.secure,
        conf={key: str(value) for key, value in extra.items() if key.startswith("spark.")},
        history_server=extra.get("history-server-url") or None,
    )


def check_reachable(target: ConnectTarget) -> None:
    """Fail within seconds, naming the server, where nothing accepts a connection at its address (gRPC would
    retry for minutes)."""
    try:
        with socket.create_connection((target.host, target.port), timeout=REACH_TIMEOUT_S):
            return
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
    raise LaunchError(
        f"Cannot reach the Spark Connect server at {target.address} (connection {target.conn_id!r}): {reason}. "
        "Start the server (start-connect-server.sh), or correct the connection's host and port."
    )


def open_session(target: ConnectTarget) -> ConnectSession:
    """A new Spark Connect session on ``target``'s server; the caller stops it (which releases it on the server)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    check_reachable(target)
    return ConnectSession.builder.remote(target.url).create()


def stop_session(spark: ConnectSession) -> None:
    """``spark.stop()``, within seconds also where the server is gone: pyspark retries releasing the session
    15 times up to 60 s apart (~10 minutes), each try up to a 10-minute deadline."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    spark.client.set_retry_policies([DefaultPolicy(max_retries=2, initial_backoff=100, max_backoff=1000)])
    bound_release(spark, STOP_TIMEOUT_S)  # pyspark's per-call deadlines have no public setter
    spark.stop()


def apply_conf(spark: ConnectSession, conf: Mapping[str, str]) -> dict[str, str | None]:
    """Set ``conf`` on the session (``spark.conf.set``) where a session may set it; return the others (the
    server's: ``spark.executor.memory``, ``spark.task.cpus``...) that the server does not have as asked, with
    the server's value (None: unset)."""
    from pyspark.errors import PySparkException

    refused: dict[str, str | None] = {}
    for key, value in conf.items():
        try:
            spark.conf.set(key, value)
        except PySparkException:  # CANNOT_MODIFY_CONFIG, CANNOT_MODIFY_STATIC_CONFIG
            have = spark.conf.get(key, None)
            if have != value:
                refused[key] = have
    return refused
