"""HorovodHook: the ``spark`` connection's master as a SparkSession, and HorovodRunner jobs on it."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, Unpack
from urllib.parse import quote, urlparse

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_hvd.hooks.keytab import KEYTAB_CONF, keytab_file, remove_keytab
from airflow_provider_hvd.hooks.shared_session import shared_session
from airflow_provider_hvd.hooks.spark_connect import CONN_TYPE as CONNECT_CONN_TYPE
from airflow_provider_hvd.hooks.spark_connect import DEFAULT_PORT as DEFAULT_CONNECT_PORT
from airflow_provider_hvd.hooks.spark_connect import (
    ConnectTarget,
    apply_conf,
    connect_target,
    is_connect_url,
    open_session,
    stop_session,
)
from airflow_provider_hvd.hooks.spark_output import SparkStartError, launch_logged_gateway, stop_gateway
from airflow_provider_hvd.hooks.spark_ui import application_ui_url, connect_ui_url
from airflow_provider_hvd.runner import HorovodRunner, LaunchError, RunCancelledError
from airflow_provider_hvd.runner.errors import ConfigurationError, JobRefusedError, SettingError
from airflow_provider_hvd.runner.jobs import attach
from airflow_provider_hvd.runner.settings import RunOptions, takes_run_settings
from airflow_provider_hvd.runner.spark import (
    CONNECT_BIND_CONF,
    CONNECT_HOST_CONF,
    default_executor_python,
    standalone_masters,
    summary,
)

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from py4j.java_gateway import JavaGateway
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.runner import Job
    from airflow_provider_hvd.runner.settings import ProgressSink

# connection extras that are not ``spark.*`` keys, as the apache-spark provider names them
_EXTRA_TO_CONF = {
    "queue": "spark.yarn.queue",
    "namespace": "spark.kubernetes.namespace",
    "principal": "spark.kerberos.principal",  # what spark-submit's --principal sets
}
# the apache-spark provider's other extras: they concern spark-submit or cluster mode, not a session in the task
_SUBMIT_ONLY_EXTRAS = {"spark-binary", "rest-scheme", "rest-port", "yarn_resourcemanager_webapp_address"}
HISTORY_SERVER_EXTRA = "history-server-url"
_KNOWN_EXTRAS = {*_EXTRA_TO_CONF, "keytab", "deploy-mode", HISTORY_SERVER_EXTRA, *_SUBMIT_ONLY_EXTRAS}
# settings a SparkContext takes when it starts: a job on a running one that differs in them would run otherwise
# than asked (the GPUs and cores of a task, the driver's fixed addresses and ports, what the ranks are given)
_SETTINGS_THAT_MATTER = (
    "spark.task.",
    "spark.executor.resource.",
    "spark.driver.resource.",
    "spark.executor.cores",
    "spark.driver.host",
    "spark.driver.bindAddress",
    "spark.driver.port",
    "spark.driver.blockManager.port",
    "spark.blockManager.port",
    "spark.horovodRunner.",
    "spark.executorEnv.",
    "spark.kerberos.",
)
# in a setting's name, any case (spark.hadoop.fs.s3a.secret.key, ...session.token, ...signature); Hadoop's Azure
# connectors name an account's key fs.azure.account.key.<account>..., a SAS token fs.azure.sas.<container>...
_SECRET_WORDS = (
    "secret",
    "password",
    "passwd",
    "token",
    "credential",
    "private",
    "keytab",
    "api_key",
    "apikey",
    "signature",
    "fs.azure.account.key.",
    "fs.azure.sas.",
)
# OpenLineage's HTTP transport: its headers (Authorization...) and its auth settings but their type
_SECRET_PREFIXES = ("spark.openlineage.transport.headers.", "spark.openlineage.transport.auth.")
_NOT_SECRET = ("spark.openlineage.transport.auth.type",)
_PY4J_CHATTER = ("py4j.clientserver", "py4j.java_gateway")  # a line at INFO each time a Python thread ends


def is_secret_setting(key: str) -> bool:
    """Whether a setting's value is a secret (a password, a token...) to be masked wherever it is logged."""
    if key.startswith(_SECRET_PREFIXES) and key not in _NOT_SECRET:
        return True
    return any(word in key.lower() for word in _SECRET_WORDS)


def masked(conf: Mapping[str, str]) -> dict[str, str]:
    """``conf`` with the values of secret settings replaced by ``***``, to be logged."""
    return {key: "***" if is_secret_setting(key) else value for key, value in conf.items()}


def _mask_in_airflow_logs(conf: Mapping[str, str]) -> None:
    """Have Airflow mask the secret values wherever they would show in the task log (Spark's own lines too)."""
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover - older task SDKs
        return
    for key, value in conf.items():
        if is_secret_setting(key) and value:
            mask_secret(value)


def master_from_connection(conn: Connection) -> tuple[str, dict[str, str]]:
    """The Spark master URL and the SparkConf settings a ``spark`` connection stands for.

    Same rules as the apache-spark provider's SparkSubmitHook: a host holding a scheme, or with no
    port, is the master as is (``local[*]``, ``yarn``, ``spark://h``, ``k8s://https://h``), otherwise
    ``<conn_type>://<host>``; then the port, when the connection has one, is appended
    (host ``spark://h`` and port 7077 → ``spark://h:7077``; the URI form ``spark://h:7077`` alike).
    Extras that are Spark settings (``spark.executor.memory``...) go into the SparkConf, as do ``queue``,
    ``namespace`` and Kerberos' ``principal`` and ``keytab`` (base64; written to a file only this user can read).
    Other extras are refused by name, except those that concern only spark-submit.
    """
    if conn.conn_type == "spark" and conn.host and ("://" in conn.host or not conn.port):
        master = conn.host
    else:
        master = f"{conn.conn_type}://{conn.host or ''}"
    if conn.port:
        master = f"{master}:{conn.port}"
    if is_connect_url(master) or conn.conn_type == CONNECT_CONN_TYPE:
        server = urlparse(master if is_connect_url(master) else f"sc://{conn.host or ''}")
        raise SettingError(
            f"Connection {conn.conn_id!r} of type {conn.conn_type!r} points at a Spark Connect server "
            f"(sc://{server.netloc}); a Connect server belongs in a connection of type {CONNECT_CONN_TYPE!r}, e.g. "
            f"`airflow connections add {conn.conn_id} --conn-type {CONNECT_CONN_TYPE} --conn-host "
            f"{server.hostname or 'HOST'} --conn-port {conn.port or server.port or DEFAULT_CONNECT_PORT}`."
        )
    extra = conn.extra_dejson
    if str(extra.get("deploy-mode", "client")).lower() == "cluster":
        raise SettingError(
            f"Connection {conn.conn_id!r} asks for deploy-mode 'cluster'; HorovodHook runs the Spark driver in "
            "the Airflow task (client mode). Remove the deploy-mode extra or set it to 'client'."
        )
    unknown = sorted(key for key in extra if not key.startswith("spark.") and key not in _KNOWN_EXTRAS)
    if unknown:
        raise SettingError(
            f"Connection {conn.conn_id!r} has extras that are neither Spark settings (spark.*) nor ones HorovodHook "
            f"knows: {', '.join(map(repr, unknown))}. Known: {', '.join(sorted(_KNOWN_EXTRAS))}; remove them, or "
            "give Spark settings their full name (e.g. spark.executor.memory)."
        )
    conf = {key: str(value) for key, value in extra.items() if key.startswith("spark.")}
    conf.update({_EXTRA_TO_CONF[key]: str(extra[key]) for key in _EXTRA_TO_CONF if extra.get(key)})
    if extra.get("keytab"):
        conf[KEYTAB_CONF] = keytab_file(conn.conn_id, str(extra["keytab"]))
    return master, conf


class ConnectionNotDefinedError(ConfigurationError, AirflowNotFoundException):
    """The hook's connection is not defined: Airflow's own error for that, and a configuration error (a retry would
    not find it either)."""


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _said_by_spark(exc: BaseException) -> bool:
    """Whether Spark refused (its JVM said why), as opposed to a bug on the Python side (its traceback tells)."""
    from py4j.protocol import Py4JError

    return isinstance(exc, (Py4JError, SparkStartError))


class JobRunner(Protocol):
    """What the hook and the operators need of a runner (HorovodRunner, TorchDistributor)."""

    metrics: dict[str, list[tuple[float, float | None]]]
    checkpoint: dict[str, Any] | None

    def cancel(self) -> None: ...
    def _on_session(self, spark: Any) -> AbstractContextManager[None]:
        """Its runs use ``spark``, the hook's session, never the thread's active one (``runner._Runner``)."""

    def _announcing(self, announce: Callable[[str], None]) -> AbstractContextManager[None]:
        """Its runs submitted within tell ``announce`` their id before their host starts (``runner._Runner``)."""


def differing_settings(running: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, tuple[str, str | None]]:
    """The settings of ``wanted`` that the running SparkContext's ``running`` settings do not have as asked."""
    return {key: (value, running.get(key)) for key, value in wanted.items() if running.get(key) != value}


class HorovodHook(BaseHook):
    """Runs HorovodRunner jobs on the Spark cluster of a ``spark`` connection, or on the Spark Connect server of a
    ``spark_connect`` connection (both the apache-spark provider's connection types).

    :param conn_id: the ``spark`` connection naming the master (default ``spark_default``), or a
        ``spark_connect`` one naming the server (the provider's default name: ``spark_connect_default``).
    :param spark_conf: Spark settings on top of the connection's (``{"spark.executor.memory": "4g"}``). On Spark
        Connect only those a session may set apply; a setting the server owns and has otherwise is refused by
        name where it matters to the job (``spark.task.*``...), else warned of.
    :param app_name: the Spark application's name (a Connect server's application keeps its own).
    :param openlineage_conf: OpenLineage's ``spark.openlineage.*`` properties for the session the hook starts
        (the operators' ``openlineage_inject_*``). A SparkContext already running keeps its own: they do not
        apply then, which is logged, and do not refuse the job; nor does Spark Connect take them.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "spark_default"
    conn_type = "spark"
    hook_name = "Horovod on Spark"

    def __init__(
        self,
        conn_id: str = default_conn_name,
        spark_conf: dict[str, Any] | None = None,
        app_name: str = "horovod",
        *,
        openlineage_conf: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.spark_conf = {key: str(value) for key, value in (spark_conf or {}).items()}
        self.openlineage_conf: dict[str, str] = {}
        self.add_openlineage_conf(openlineage_conf or {})
        self.app_name = app_name
        self._runner: JobRunner | None = None
        self._cancelled = False
        self._gateway: JavaGateway | None = None  # the JVM this hook started, if it did
        self.ui_url: str | None = None
        #: the SparkSession of the job :meth:`run_job` is running (None outside it, and for a local job)
        self.job_session: SparkSession | ConnectSession | None = None
        self.history_server: str | None = None

    def add_openlineage_conf(self, conf: Mapping[str, str]) -> None:
        """OpenLineage's properties for the session the hook starts, those ``spark_conf`` does not set (an
        operator adds them once its hook exists: a :meth:`cancel` meanwhile is not lost)."""
        self.openlineage_conf.update({key: value for key, value in conf.items() if key not in self.spark_conf})

    def _connection(self) -> Connection:
        try:
            return self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            runner = type(self._runner).__name__ if self._runner is not None else "HorovodRunner"
            raise ConnectionNotDefinedError(
                f"The Spark connection {self.conn_id!r} is not defined. Define it with the master {runner} "
                f"should use, e.g. AIRFLOW_CONN_{self.conn_id.upper()}='spark://spark-master:7077' or "
                f'AIRFLOW_CONN_{self.conn_id.upper()}=\'{{"conn_type": "spark", "host": "local[*]"}}\', '
                f"or `airflow connections add {self.conn_id} --conn-type spark --conn-host 'local[*]'`; for a "
                f"Spark Connect server, `--conn-type {CONNECT_CONN_TYPE} --conn-host HOST --conn-port 15002`."
            ) from None

    def connect_target(self) -> ConnectTarget | None:
        """Where the connection points when it is a ``spark_connect`` one (None for a ``spark`` connection)."""
        return self._target_of(self._connection())

    @staticmethod
    def _target_of(conn: Connection) -> ConnectTarget | None:
        if conn.conn_type != CONNECT_CONN_TYPE:
            return None
        target = connect_target(conn)
        if conn.password:  # the token, wherever it would show in the task log
            _mask_in_airflow_logs({"token": conn.password, "quoted token": quote(conn.password)})
        return target

    def resolve(self) -> tuple[str, dict[str, str]]:
        """The master URL and the SparkConf settings: the connection's, then ``openlineage_conf``, ``spark_conf``."""
        conn = self._connection()
        master, conf = master_from_connection(conn)
        self.history_server = conn.extra_dejson.get(HISTORY_SERVER_EXTRA) or None
        conf = {**conf, **self.openlineage_conf, **self.spark_conf}
        _mask_in_airflow_logs(conf)
        return master, conf

    def get_conn(self) -> SparkSession:
        """The SparkSession on the connection's master (the running one if it already matches).

        Stop it, then call :meth:`stop`, to end the JVM the hook may have started for it. On a ``spark_connect``
        connection, a new Spark Connect session of its own: stopping it releases it on the server.
        """
        target = self.connect_target()
        if target is not None:
            return self._connect_session(target)  # type: ignore[return-value]  # Connect's SparkSession
        return self._session()[0]

    def _connect_session(self, target: ConnectTarget) -> ConnectSession:
        """A Spark Connect session of this hook's own on ``target``'s server, with ``spark_conf`` applied."""
        from pyspark.errors import PySparkException

        conf = {**target.conf, **self.spark_conf}
        _mask_in_airflow_logs(conf)
        self.log.info("Opening a session on the %s", target.describe())
        try:
            spark = open_session(target)
        except PySparkException as exc:  # the server's refusal, not a bug: its words are what tells
            raise self._connect_failed(target, exc) from None
        try:
            self._check_server_owned(apply_conf(spark, conf), conf)
        except PySparkException as exc:
            stop_session(spark)
            raise self._connect_failed(target, exc) from None
        except BaseException:
            stop_session(spark)
            raise
        return spark

    @staticmethod
    def _connect_failed(target: ConnectTarget, exc: BaseException) -> LaunchError:
        return LaunchError(
            f"Could not open a Spark Connect session at {target.address} (connection {target.conn_id!r}): "
            f"{summary(exc, first_line=True)}"
        )

    def _check_server_owned(self, refused: Mapping[str, str | None], conf: Mapping[str, str]) -> None:
        """Refuse the settings a session cannot set that matter to the job; warn of the others."""
        address = (
            f" The address the ranks reach this task at is {CONNECT_HOST_CONF} (and where it listens, "
            f"{CONNECT_BIND_CONF}) on Spark Connect."
            if {"spark.driver.host", "spark.driver.bindAddress"} & set(refused)
            else ""
        )
        self._refuse_or_warn(
            {key: (conf[key], have) for key, have in refused.items()},
            "server",
            f"These settings of connection {self.conn_id!r} and spark_conf are the Spark Connect server's, which has "
            "them otherwise; a session cannot set them",
            f"Set them where the server starts (start-connect-server.sh --conf KEY=VALUE), or remove them.{address}",
            "These settings of connection %r and spark_conf are the Spark Connect server's and do not apply (set "
            "them where the server starts: start-connect-server.sh --conf KEY=VALUE): %s",
            self.conn_id,
        )

    def _refuse_or_warn(
        self,
        differing: Mapping[str, tuple[str, str | None]],
        held_by: str,
        refusal: str,
        fix: str,
        warning: str,
        *warning_args: object,
    ) -> None:
        """Settings asked for that the Spark application has otherwise (``held_by``: the server, the running
        SparkContext) and keeps: refuse the job where one matters to it (``refusal: the settings. fix``), else warn
        of them (``warning``, its last ``%s`` the settings). Secrets show as ``***``."""
        if not differing:
            return
        lines = ", ".join(
            f"{key}={'***' if is_secret_setting(key) else wanted} ({held_by}: "
            f"{'***' if is_secret_setting(key) and have else have or 'unset'})"
            for key, (wanted, have) in sorted(differing.items())
        )
        if any(key.startswith(_SETTINGS_THAT_MATTER) for key in differing):
            raise JobRefusedError(f"{refusal}: {lines}. {fix}")
        self.log.warning(warning, *warning_args, lines)

    def _check_master(self, master: str) -> None:
        """Fail fast, with the connection's name, where Spark would answer with a JVM stack trace or a long wait."""
        try:
            masters = standalone_masters(master)
        except ValueError as exc:
            raise JobRefusedError(
                f"Connection {self.conn_id!r} gives the Spark master URL {master!r}, which Spark cannot use: {exc}. "
                "Give the port once: in the connection's Port field or in its Host."
            ) from None
        if masters and not any(_listening(host, port) for host, port in masters):
            raise LaunchError(
                f"Nothing listens at the Spark master {master} of connection {self.conn_id!r}: start the master, "
                "or correct the connection's host and port."
            )

    def _check_running(self, running: SparkContext, master: str, conf: dict[str, str]) -> None:
        """Join a running SparkContext only where it runs the job as asked: refuse where a setting that matters
        differs (its settings cannot change once it runs), and say which others it ignores."""
        if running.master != master:
            raise RuntimeError(
                f"A SparkContext on {running.master} is already running in this process, and connection "
                f"{self.conn_id!r} asks for {master}: Spark allows one per process. Stop the other one first."
            )
        self._refuse_or_warn(
            differing_settings(dict(running.getConf().getAll()), conf),
            "running",
            f"The SparkContext already running in this process on {master} differs from what connection "
            f"{self.conn_id!r} and spark_conf ask for",
            "A running SparkContext keeps the settings it started with; run this job after the other one ends (or "
            "stop that SparkContext), or ask for the running one's settings.",
            "Joining the SparkContext already running on %s, which keeps the settings it started with; these of "
            "connection %r and spark_conf do not apply: %s",
            master,
            self.conn_id,
        )

    def _say_lineage_not_applied(self, running: SparkContext) -> None:
        """OpenLineage's Spark listener reads its properties from the SparkContext's settings, which a running one
        keeps: this job's parent job and transport do not reach it (its Spark events name the running one's)."""
        differing = differing_settings(dict(running.getConf().getAll()), self.openlineage_conf)
        if differing:
            self.log.warning(
                "OpenLineage's properties of this job do not apply: the SparkContext already running in this "
                "process keeps those it started with, and OpenLineage's Spark listener reads them there: %s",
                ", ".join(
                    f"{key}={masked({key: wanted})[key]} (running: {masked({key: have})[key] if have else 'unset'})"
                    for key, (wanted, have) in sorted(differing.items())
                ),
            )

    def _session(self) -> tuple[SparkSession, bool]:
        from pyspark import SparkConf, SparkContext
        from pyspark.sql import SparkSession

        master, conf = self.resolve()
        for name in _PY4J_CHATTER:  # py4j's INFO lines are about its own connections: noise in a task log
            if logging.getLogger(name).level == logging.NOTSET:  # unless set on purpose
                logging.getLogger(name).setLevel(logging.WARNING)
        running = SparkContext._active_spark_context
        if running is not None:
            remove_keytab(conf, unless_used_by=dict(running.getConf().getAll()))  # the running one keeps its own
            self._check_running(running, master, {k: v for k, v in conf.items() if k not in self.openlineage_conf})
            self._say_lineage_not_applied(running)
            return SparkSession.builder.getOrCreate(), False
        self._check_master(master)
        # pyspark's driver takes the executors' Python from the environment, not from the SparkConf
        if "spark.pyspark.python" in conf:
            os.environ["PYSPARK_PYTHON"] = conf["spark.pyspark.python"]
        else:
            default_executor_python(master)
        conf = {"spark.ui.showConsoleProgress": "false", **conf}  # a progress bar is noise in a task log
        self.log.info("Starting a Spark session on %s with %s", master, masked(conf))
        try:
            self._gateway = launch_logged_gateway(
                SparkConf().setMaster(master).setAppName(self.app_name).setAll(list(conf.items()))
            )
            builder = SparkSession.builder.master(master).appName(self.app_name)
            for key, value in conf.items():
                builder = builder.config(key, value)
            return builder.getOrCreate(), True
        except Exception as exc:
            reason = summary(exc, first_line=True)
            self.stop()
            remove_keytab(conf)
            error = LaunchError(f"Could not start a Spark session on {master} (connection {self.conn_id!r}): {reason}")
            if _said_by_spark(exc):
                raise error from None  # the JVM's stack trace would bury the reason
            raise error from exc  # a bug: its traceback is what tells

    @takes_run_settings()
    def run(
        self,
        python_callable: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        np: int,
        **settings: Unpack[RunOptions],
    ) -> Any:
        """Run ``python_callable(*args, **kwargs)`` on ``np`` Horovod ranks; return rank 0's value.

        ``np > 0`` runs a Spark barrier job on the connection's cluster (the session is stopped afterwards
        if this hook started it), waiting up to ``slot_wait_timeout`` seconds for a busy cluster's task
        slots (over Spark Connect without the server's Spark UI, up to the ranks' start timeout, 120 s);
        ``np < 0`` runs the ranks in this process's host, without Spark. The other parameters are the run
        settings, :class:`HorovodRunner`'s (:class:`~airflow_provider_hvd.runner.settings.RunSettings`); the
        runner stays at ``runner`` afterwards (its ``metrics``, ``checkpoint``, ``mlflow_run_url``).
        """
        runner = HorovodRunner(np=np, **settings)
        return self.run_job(runner, lambda: runner.run_with_args(python_callable, args, kwargs or {}), local=np < 0)

    def run_job(self, runner: JobRunner, job: Callable[[], Any], *, local: bool) -> Any:
        """Run ``job()``, which runs ``runner``'s job, and return its value; :meth:`cancel` then cancels ``runner``.

        ``local``: the job runs on this host's processes, without Spark. Otherwise it runs on the connection's
        SparkSession, started first (and stopped afterwards if this hook started it), whose UI is logged.
        """
        self._runner = runner
        if self._cancelled:  # cancel() came before the job
            raise RunCancelledError("the job was cancelled before its ranks started")
        if local:
            return job()
        target = self.connect_target()
        if target is not None:
            return self._run_on_connect(target, runner, job)
        spark, shared = self._join_session()
        try:
            sc = spark.sparkContext
            self.ui_url = application_ui_url(sc, self.history_server)
            ui = f", Spark UI {self.ui_url}" if self.ui_url else ""
            self.log.info("Spark master %s, application %s%s", sc.master, sc.applicationId, ui)
            if self._cancelled:  # cancel() came while the session started
                raise RunCancelledError("the job was cancelled before its ranks started")
            with runner._on_session(spark), self._job_on(spark):  # not the thread's active one: it may be Connect's
                return job()
        finally:
            if shared:
                shared_session.leave(spark)

    def _run_on_connect(
        self,
        target: ConnectTarget,
        runner: JobRunner,
        job: Callable[[], Any],
        around: AbstractContextManager[Any] | None = None,
    ) -> Any:
        """``job()`` on a Spark Connect session of its own, handed to ``runner`` (pyspark makes it the thread's
        active session only where none is), within ``around``; the session released afterwards."""
        if self.openlineage_conf:
            self.log.warning(
                "OpenLineage's properties of this job do not apply on Spark Connect: the server's SparkContext keeps "
                "the settings it started with, and OpenLineage's Spark listener reads them there (%s)",
                ", ".join(sorted(self.openlineage_conf)),
            )
        spark = self._connect_session(target)
        try:
            self.ui_url, no_link = connect_ui_url(spark, self.history_server or target.history_server)
            app = spark.conf.get("spark.app.id", None)
            ui = f", Spark UI {self.ui_url}" if self.ui_url else f"; no Spark UI link: {no_link}"
            self.log.info("Running over Spark Connect at %s: application %s%s", target.address, app, ui)
            if self._cancelled:  # cancel() came while the session opened
                raise RunCancelledError("the job was cancelled before its ranks started")
            with runner._on_session(spark), self._job_on(spark), around or contextlib.nullcontext():
                return job()
        finally:
            stop_session(spark)  # within seconds also where the server died during the job

    def submit_job(
        self, runner: JobRunner, submit: Callable[[], Job], announce: Callable[[str], None] | None = None
    ) -> Job:
        """Start ``submit()``, which submits ``runner``'s job, on the ``spark_connect`` connection's server; the
        run's handle (the run goes on without this process). ``announce`` is told the run's id before its host
        starts. The hook's own session is released once the run is submitted: the run has sessions of its own."""
        self._runner = runner
        if self._cancelled:
            raise RunCancelledError("the job was cancelled before its ranks started")
        target = self.connect_target()
        if target is None:
            raise JobRefusedError(
                f"Connection {self.conn_id!r} is a classic Spark one: a run on it has its driver in this process and "
                f"cannot outlive it; a run that outlives the task needs a {CONNECT_CONN_TYPE} connection."
            )
        announced = runner._announcing(announce) if announce is not None else contextlib.nullcontext()
        job: Job = self._run_on_connect(target, runner, submit, announced)
        return job

    def attach_job(
        self,
        job_id: str,
        progress_sink: ProgressSink | None = None,
        *,
        logs: bool = True,
        fetch: bool = True,
        on_mlflow_run: Callable[[str, str | None], None] | None = None,
    ) -> Job:
        """The handle of a run submitted on this connection's server (``airflow_provider_hvd.attach``), with the
        connection's token; JobNotFoundError when the run has ended."""
        conn = self._connection()
        target = self._target_of(conn)
        token = conn.password if target is not None and target.has_token else None
        return attach(
            job_id,
            token=token or None,
            progress_sink=progress_sink,
            logs=logs,
            fetch=fetch,
            on_mlflow_run=on_mlflow_run,
        )

    @contextlib.contextmanager
    def _job_on(self, spark: SparkSession | ConnectSession) -> Iterator[None]:
        """:attr:`job_session` is ``spark`` while the job runs (the operators build its DataFrame there)."""
        self.job_session = spark
        try:
            yield
        finally:
            self.job_session = None

    @property
    def runner(self) -> JobRunner | None:
        """The runner of the last :meth:`run` or :meth:`run_job`."""
        return self._runner

    def _join_session(self) -> tuple[SparkSession, bool]:
        """The session for a job, and whether it is the one hooks share (a SparkContext the user started is not)."""

        def session() -> tuple[SparkSession, JavaGateway | None, bool]:
            spark, started = self._session()
            gateway, self._gateway = (self._gateway, None) if started else (None, self._gateway)
            return spark, gateway, started

        return shared_session.join(session)

    def stop(self) -> None:
        """End the Spark driver's JVM if this hook started it (its SparkContext must have stopped)."""
        if self._gateway is not None:
            stop_gateway(self._gateway)
            self._gateway = None

    def cancel(self) -> None:
        """End the running job: every rank is ended and the Spark job cancelled; ``run`` then raises."""
        self._cancelled = True
        if self._runner is not None:
            self._runner.cancel()
