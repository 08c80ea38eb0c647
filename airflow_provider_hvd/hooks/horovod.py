"""HorovodHook: the ``spark`` connection's master as a SparkSession, and HorovodRunner jobs on it."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_hvd.runner import HorovodRunner
from airflow_provider_hvd.runner.spark_launch import default_executor_python

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from pyspark.sql import SparkSession

# connection extras that are not ``spark.*`` keys, as the apache-spark provider names them
_EXTRA_TO_CONF = {"queue": "spark.yarn.queue", "namespace": "spark.kubernetes.namespace"}


def master_from_connection(conn: Connection) -> tuple[str, dict[str, str]]:
    """The Spark master URL and the SparkConf settings a ``spark`` connection stands for.

    Same rules as the apache-spark provider's SparkSubmitHook: a host holding a scheme, or with no
    port, is the master as is (``local[*]``, ``yarn``, ``spark://h:7077``, ``k8s://https://h:443``);
    otherwise ``<conn_type>://<host>[:<port>]`` (the URI form ``spark://h:7077``). Extras that are
    Spark settings (``spark.executor.memory``...) go into the SparkConf, as do ``queue`` and ``namespace``.
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
        self.ui_url: str | None = None

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
        return master, {**conf, **self.spark_conf}

    def get_conn(self) -> SparkSession:
        """The SparkSession on the connection's master (the running one if it already matches)."""
        return self._session()[0]

    def _session(self) -> tuple[SparkSession, bool]:
        from pyspark import SparkContext
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
        # pyspark's driver takes the executors' Python from the environment, not from the SparkConf
        if "spark.pyspark.python" in conf:
            os.environ["PYSPARK_PYTHON"] = conf["spark.pyspark.python"]
        else:
            default_executor_python(master)
        builder = SparkSession.builder.master(master).appName(self.app_name)
        for key, value in conf.items():
            builder = builder.config(key, value)
        return builder.getOrCreate(), True

    def run(
        self,
        python_callable: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
    ) -> Any:
        """Run ``python_callable(*args, **kwargs)`` on ``np`` Horovod ranks; return rank 0's value.

        ``np > 0`` runs a Spark barrier job on the connection's cluster (the session is stopped afterwards
        if this hook started it); ``np < 0`` runs the ranks in this process's host, without Spark.
        """
        self._runner = HorovodRunner(np=np, driver_log_verbosity=driver_log_verbosity)
        if np < 0:
            return self._runner.run_with_args(python_callable, args, kwargs or {})
        spark, owned = self._session()
        self.ui_url = spark.sparkContext.uiWebUrl
        self.log.info("Spark master %s, application %s", spark.sparkContext.master, spark.sparkContext.applicationId)
        try:
            return self._runner.run_with_args(python_callable, args, kwargs or {})
        finally:
            if owned:
                spark.stop()

    def cancel(self) -> None:
        """End the running job: every rank is ended and the Spark job cancelled; ``run`` then raises."""
        if self._runner is not None:
            self._runner.cancel()
