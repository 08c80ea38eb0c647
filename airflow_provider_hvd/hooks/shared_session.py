"""The SparkSession that hooks started in this process, shared while any hook's job runs on it.

Spark allows one SparkContext per process; hooks running jobs at once (threads of a notebook or a service)
share it, and the last one to finish stops it and the JVM started for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from airflow_provider_hvd.hooks.keytab import remove_keytab
from airflow_provider_hvd.hooks.spark_output import stop_gateway

if TYPE_CHECKING:
    from py4j.java_gateway import JavaGateway
    from pyspark.sql import SparkSession


class SharedSession:
    """Who uses the hooks' SparkSession, and the JVM started for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.users = 0
        self._gateway: JavaGateway | None = None

    def join(self, session: Callable[[], tuple[SparkSession, JavaGateway | None, bool]]) -> tuple[SparkSession, bool]:
        """The session ``session()`` gives (the running one, or one it starts), and whether hooks share it.

        ``session()`` returns the SparkSession, the JVM it started for it if any, and whether it started the
        SparkContext. A SparkContext that the application started itself is not shared: it stops it.
        """
        with self._lock:
            spark, gateway, started = session()
            if started:
                self._gateway, self.users = gateway, 1
                return spark, True
            if self.users:  # the running SparkContext is the one hooks share
                self.users += 1
                return spark, True
            return spark, False

    def leave(self, spark: SparkSession) -> None:
        """One job is done with the shared session; the last one stops it and its JVM."""
        with self._lock:
            self.users -= 1
            if self.users:
                return
            conf = dict(spark.sparkContext.getConf().getAll())
            try:
                spark.stop()
            finally:
                remove_keytab(conf)  # the keytab the session was started with, written for it
                gateway, self._gateway = self._gateway, None
                if gateway is not None:
                    stop_gateway(gateway)


#: the hooks of this process
shared_session = SharedSession()
