"""The "Spark UI" extra link: a page about the application that still answers after the task ended.

The driver's own UI (``http://driver:4040``) stops with its SparkContext, so it is never the link. In order:
a Spark History Server when one is configured (the connection's ``history-server-url`` extra, or
``spark.yarn.historyServer.address``), YARN's tracking URL, the standalone master's application page;
otherwise no link rather than a dead one. On Spark Connect the server's own UI outlives the task: the link is
the application's page there, where the server's driver host and UI port answer with its application.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from airflow_provider_hvd.runner.spark import server_ui, session_conf, state_of, web_ui_of

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql.connect.session import SparkSession as ConnectSession

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


def _lasting_url_of(
    master: str,
    app_id: str,
    conf: Callable[[str], str | None],
    *,
    attempt_id: str | None = None,
    history_server: str | None = None,
) -> str | None:
    """:func:`lasting_ui_url` of an application known by its master URL and conf getter (the standalone master's
    UI asked where the master is a standalone one)."""
    master_ui = web_ui_of(master, conf) if master.startswith("spark://") and state_of(master, conf)[0] else None
    settings = {key: value for key in (HISTORY_SERVER_CONF, YARN_PROXY_CONF) if (value := conf(key))}
    return lasting_ui_url(
        master, app_id, settings, attempt_id=attempt_id, history_server=history_server, master_ui=master_ui
    )


def application_ui_url(sc: SparkContext, history_server: str | None = None) -> str | None:
    """:func:`lasting_ui_url` for a running SparkContext."""
    attempt = sc._jsc.sc().applicationAttemptId()  # a Scala Option
    return _lasting_url_of(
        sc.master or "",
        sc.applicationId,
        sc.getConf().get,
        attempt_id=attempt.get() if attempt.isDefined() else None,
        history_server=history_server,
    )


def connect_ui_url(spark: ConnectSession, history_server: str | None = None) -> tuple[str | None, str]:
    """The page of a Spark Connect server's application, and why there is none when it is None.

    As :func:`lasting_ui_url` for the server's application (a History Server, YARN's proxy, the standalone
    master's application page), else the jobs page of the server's own UI (``runner.spark.server_ui``).
    """
    conf = session_conf(spark)
    app_id = conf("spark.app.id")
    if not app_id:
        return None, "the Spark Connect server does not say its application's id (spark.app.id)"
    lasting = _lasting_url_of(conf("spark.master") or "", app_id, conf, history_server=history_server)
    if lasting:
        return lasting, ""
    ui, why = server_ui(conf)
    return (f"{ui}/jobs/", "") if ui else (None, why)
