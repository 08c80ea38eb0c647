"""The "Spark UI" extra link: a page about the application that still answers after the task ended.

The driver's own UI (``http://driver:4040``) stops with its SparkContext, so it is never the link. In order:
a Spark History Server when one is configured (the connection's ``history-server-url`` extra, or
``spark.yarn.historyServer.address``), YARN's tracking URL, the standalone master's application page;
otherwise no link rather than a dead one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from airflow_provider_hvd.runner.driver.spark_cluster import master_state, master_web_ui

if TYPE_CHECKING:
    from pyspark import SparkContext

HISTORY_SERVER_CONF = "spark.yarn.historyServer.address"
# set by Spark's YARN scheduler backend on the driver: the ResourceManager proxy of this application
YARN_PROXY_CONF = "spark.org.apache.hadoop.yarn.server.webproxy.amfilter.AmIpFilter.param.PROXY_URI_BASES"


def lasting_ui_url(
    master: str,
    app_id: str,
    conf: Mapping[str, str],
    *,
    attempt_id: str | None = None,
    history_server: str | None = None,
    master_ui: str | None = None,
) -> str | None:
    """The application's page that outlives it, or None when there is none to point at.

    :param master_ui: the standalone master's web UI, when it answered (None otherwise).
    """
    history = history_server or conf.get(HISTORY_SERVER_CONF)
    if history:
        base = history if "://" in history else f"http://{history}"
        return f"{base.rstrip('/')}/history/{app_id}/" + (f"{attempt_id}/" if attempt_id else "")
    if master.startswith("yarn") and conf.get(YARN_PROXY_CONF):
        return conf[YARN_PROXY_CONF].split(",")[0].rstrip("/") + "/"
    if master.startswith("spark://") and master_ui:
        return f"{master_ui}/app/?appId={app_id}"
    return None


def application_ui_url(sc: SparkContext, history_server: str | None = None) -> str | None:
    """:func:`lasting_ui_url` for a running SparkContext."""
    attempt = sc._jsc.sc().applicationAttemptId()  # a Scala Option
    master = sc.master or ""
    return lasting_ui_url(
        master,
        sc.applicationId,
        dict(sc.getConf().getAll()),
        attempt_id=attempt.get() if attempt.isDefined() else None,
        history_server=history_server,
        master_ui=master_web_ui(sc) if master.startswith("spark://") and master_state(sc) else None,
    )
