"""HorovodHook: the ``spark`` connection's master as a SparkSession, and HorovodRunner jobs on it."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_hvd.hooks.spark_output import launch_logged_gateway, stop_gateway
from airflow_provider_hvd.hooks.spark_ui import application_ui_url
from airflow_provider_hvd.runner import HorovodRunner, LaunchError, RunCancelledError
from airflow_provider_hvd.runner.driver.progress import ProgressSink
from airflow_provider_hvd.runner.driver.slots import DEFAULT_SLOT_WAIT_S
from airflow_provider_hvd.runner.driver.spark_cluster import default_executor_python, standalone_masters

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from py4j.java_gateway import JavaGateway
    from pyspark.sql import SparkSession

# connection extras that are not ``spark.*`` keys, as the apache-spark provider names them
_EXTRA_TO_CONF = {"queue": "spark.yarn.queue", "namespace": "spark.kubernetes.namespace"}


class _SharedSession:
    """The SparkSession that hooks started in this process, kept while any hook's job runs on it.

    Spark allows one SparkContext per process; hooks running jobs at once (threads of a notebook or a
    service) share it, and the last one to finish stops it and the JVM started for it.
    """

    lock = threading.Lock()
    users = 0
    gateway: JavaGateway | None = None


def master_from_connection(conn: Connection) -> tuple[str, dict[str, str]]:
    """The Spark master URL and the SparkConf settings a ``spark`` connection stands for.

    Same rules as the apache-spark provider's SparkSubmitHook: a host holding a scheme, or with no
    port, is the master as is (``local[*]``, ``yarn``, ``spark://h``, ``k8s://https://h``), otherwise
    ``<conn_type>://<host>``; then the port, when the connection has one, is appended
    (host ``spark://h`` and port 7077 → ``spark://h:7077``; the URI form ``spark://h:7077`` alike).
    Extras that are Spark settings (``spark.executor.memory``...) go into the SparkConf, as do
    ``queue`` and ``namespace``.
    """
    if conn.conn_type == "spark" and conn.host and ("://" in conn.host or not conn.port):
        master = conn.host
    else:
        master = f"{conn.conn_type}://{conn.host or ''}"
    if conn.port:
        master = f"{master}:{conn.port}"
    if master.startswith("sc://") or conn.conn_type == "spark_connect":
        raise ValueError(
            f"Connection {conn.conn_id!r} points at Spark Connect ({master}); HorovodRunner needs a classic "
            "SparkContext to run its barrier job. Point it at the cluster's master (spark://, yarn, k8s://, local[*])."
        )
    extra = conn.extra_dejson
    if str(extra.get("deploy-mode", "client")).lower() == "cluster":
        raise ValueError(
            f"Connection {conn.conn_id!r} asks for deploy-mode 'cluster'; HorovodHook runs the Spark driver in "
            "the Airflow task (client mode). Remove the deploy-mode extra or set it to 'client'."
        )
    conf = {key: str(value) for key, value in extra.items() if key.startswith("spark.")}
    conf.update({_EXTRA_TO_CONF[key]: str(extra[key]) for key in _EXTRA_TO_CONF if extra.get(key)})
    return master, conf


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _first_line(exc: BaseException) -> str:
    """What went wrong, without py4j's preamble or the JVM's stack trace."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        return str(java.toString())
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


class HorovodHook(BaseHook):
    """Runs HorovodRunner jobs on the Spark cluster of a ``spark`` connection (the apache-spark provider's).

    :param conn_id: the ``spark`` connection naming the master (default ``spark_default``).
    :param spark_conf: Spark settings on top of the connection's (``{"spark.executor.memory": "4g"}``).
    :param app_name: the Spark application's name.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "spark_default"
    conn_type = "spark"
    hook_name = "Horovod on Spark"

    def __init__(
        self, conn_id: str = default_conn_name, spark_conf: dict[str, Any] | None = None, app_name: str = "horovod"
    ) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.spark_conf = {key: str(value) for key, value in (spark_conf or {}).items()}
        self.app_name = app_name
        self._runner: HorovodRunner | None = None
        self._cancelled = False
        self._gateway: JavaGateway | None = None  # the JVM this hook started, if it did
        self.ui_url: str | None = None
        self.history_server: str | None = None

    def resolve(self) -> tuple[str, dict[str, str]]:
        """The master URL and the SparkConf settings: the connection's, then ``spark_conf``."""
        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            raise AirflowNotFoundException(
                f"The Spark connection {self.conn_id!r} is not defined. Define it with the master HorovodRunner "
                f"should use, e.g. AIRFLOW_CONN_{self.conn_id.upper()}='spark://spark-master:7077' or "
                f"AIRFLOW_CONN_{self.conn_id.upper()}='{{\"conn_type\": \"spark\", \"host\": \"local[*]\"}}', "
                f"or `airflow connections add {self.conn_id} --conn-type spark --conn-host 'local[*]'`."
            ) from None
        master, conf = master_from_connection(conn)
        self.history_server = conn.extra_dejson.get("history-server-url") or None
        return master, {**conf, **self.spark_conf}

    def get_conn(self) -> SparkSession:
        """The SparkSession on the connection's master (the running one if it already matches).

        Stop it, then call :meth:`stop`, to end the JVM the hook may have started for it.
        """
        return self._session()[0]

    def _check_master(self, master: str) -> None:
        """Fail fast, with the connection's name, where Spark would answer with a JVM stack trace or a long wait."""
        try:
            masters = standalone_masters(master)
        except ValueError as exc:
            raise LaunchError(
                f"Connection {self.conn_id!r} gives the Spark master URL {master!r}, which Spark cannot use: {exc}. "
                "Give the port once: in the connection's Port field or in its Host."
            ) from None
        if masters and not any(_listening(host, port) for host, port in masters):
            raise LaunchError(
                f"Nothing listens at the Spark master {master} of connection {self.conn_id!r}: start the master, "
                "or correct the connection's host and port."
            )

    def _session(self) -> tuple[SparkSession, bool]:
        from pyspark import SparkConf, SparkContext
        from pyspark.sql import SparkSession

        master, conf = self.resolve()
        running = SparkContext._active_spark_context
        if running is not None:
            if running.master != master:
                raise RuntimeError(
                    f"A SparkContext on {running.master} is already running in this process, and connection "
                    f"{self.conn_id!r} asks for {master}: Spark allows one per process. Stop the other one first."
                )
            return SparkSession.builder.getOrCreate(), False
        self._check_master(master)
        # pyspark's driver takes the executors' Python from the environment, not from the SparkConf
        if "spark.pyspark.python" in conf:
            os.environ["PYSPARK_PYTHON"] = conf["spark.pyspark.python"]
        else:
            default_executor_python(master)
        conf = {"spark.ui.showConsoleProgress": "false", **conf}  # a progress bar is noise in a task log
        try:
            self._gateway = launch_logged_gateway(
                SparkConf().setMaster(master).setAppName(self.app_name).setAll(conf.items())
            )
            builder = SparkSession.builder.master(master).appName(self.app_name)
            for key, value in conf.items():
                builder = builder.config(key, value)
            return builder.getOrCreate(), True
        except Exception as exc:  # noqa: BLE001 - one sentence instead of py4j's JVM stack trace
            reason = _first_line(exc)  # asks the JVM: before it is stopped
            self.stop()
            raise LaunchError(
                f"Could not start a Spark session on {master} (connection {self.conn_id!r}): {reason}"
            ) from None

    def run(
        self,
        python_callable: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        resume_from: dict[str, Any] | str | None = None,
        progress_sink: ProgressSink | None = None,
        stall_timeout: float | timedelta | None = None,
    ) -> Any:
        """Run ``python_callable(*args, **kwargs)`` on ``np`` Horovod ranks; return rank 0's value.

        ``np > 0`` runs a Spark barrier job on the connection's cluster (the session is stopped afterwards
        if this hook started it), waiting up to ``slot_wait_timeout`` seconds for a busy cluster's task
        slots; ``np < 0`` runs the ranks in this process's host, without Spark. ``resume_from``,
        ``progress_sink`` and ``stall_timeout`` are :class:`HorovodRunner`'s; the runner stays at
        :attr:`runner` afterwards (its ``metrics`` and ``checkpoint``).
        """
        self._runner = HorovodRunner(
            np=np, driver_log_verbosity=driver_log_verbosity, slot_wait_timeout=slot_wait_timeout,
            resume_from=resume_from, progress_sink=progress_sink, stall_timeout=stall_timeout,
        )
        if np < 0:
            return self._runner.run_with_args(python_callable, args, kwargs or {})
        spark, shared = self._join_session()
        sc = spark.sparkContext
        self.ui_url = application_ui_url(sc, self.history_server)
        self.log.info("Spark master %s, application %s, UI %s", sc.master, sc.applicationId, self.ui_url or "-")
        try:
            if self._cancelled:  # cancel() came while the session started
                raise RunCancelledError("the job was cancelled before its ranks started")
            return self._runner.run_with_args(python_callable, args, kwargs or {})
        finally:
            if shared:
                self._leave_session(spark)

    @property
    def runner(self) -> HorovodRunner | None:
        """The runner of the last :meth:`run`."""
        return self._runner

    def _join_session(self) -> tuple[SparkSession, bool]:
        """The session for a job, and whether it is the one hooks share (a SparkContext the user started is not)."""
        with _SharedSession.lock:
            spark, started = self._session()
            if started:
                _SharedSession.gateway, self._gateway = self._gateway, None
                _SharedSession.users = 1
                return spark, True
            if _SharedSession.users:  # the running SparkContext is the one hooks share
                _SharedSession.users += 1
                return spark, True
            return spark, False  # the application's own SparkContext: it stops it

    @staticmethod
    def _leave_session(spark: SparkSession) -> None:
        with _SharedSession.lock:
            _SharedSession.users -= 1
            if _SharedSession.users == 0:
                spark.stop()
                if _SharedSession.gateway is not None:
                    stop_gateway(_SharedSession.gateway)
                    _SharedSession.gateway = None

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
