"""The Spark helpers the Airflow layer uses, from the runner's launcher (its public face for them): the kind of
master, Spark's error text, a session's conf, the standalone master's web UI and state, a Connect server's own
Spark UI, the bounded release of a Connect session, and where the driver listens over Spark Connect."""

from __future__ import annotations

from .driver.launch.address import CONNECT_BIND_CONF, CONNECT_HOST_CONF
from .driver.launch.spark.cluster import (
    default_executor_python,
    session_conf,
    standalone_masters,
    state_of,
    summary,
    web_ui_of,
)
from .driver.launch.spark.connect_client import bound_release
from .driver.launch.spark.server_ui import server_ui

__all__ = [
    "CONNECT_BIND_CONF",
    "CONNECT_HOST_CONF",
    "bound_release",
    "default_executor_python",
    "server_ui",
    "session_conf",
    "standalone_masters",
    "state_of",
    "summary",
    "web_ui_of",
]
