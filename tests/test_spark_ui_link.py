"""The "Spark UI" extra link points at a page that outlives the task (the driver's own UI does not)."""

from __future__ import annotations

import pytest

from airflow_provider_hvd.hooks.spark_ui import HISTORY_SERVER_CONF, YARN_PROXY_CONF, lasting_ui_url

APP = "app-20260101000000-0007"
YARN_APP = "application_1767225600000_0042"


@pytest.mark.parametrize(
    ("master", "app_id", "conf", "options", "link"),
    [
        # standalone: the master's application page, while the master answers
        ("spark://m:7077", APP, {}, {"master_ui": "http://m:8080"}, f"http://m:8080/app/?appId={APP}"),
        ("spark://m:7077", APP, {}, {}, None),
        # YARN: the ResourceManager's proxy of the application (its tracking URL), set by Spark on the driver
        (
            "yarn",
            YARN_APP,
            {YARN_PROXY_CONF: f"http://rm1:8088/proxy/{YARN_APP},http://rm2:8088/proxy/{YARN_APP}"},
            {},
            f"http://rm1:8088/proxy/{YARN_APP}/",
        ),
        # a History Server, configured on the connection or as YARN's, wins: it outlives the cluster's own pages
        (
            "yarn",
            YARN_APP,
            {YARN_PROXY_CONF: "http://rm:8088/proxy/x", HISTORY_SERVER_CONF: "shs:18080"},
            {"attempt_id": "1"},
            f"http://shs:18080/history/{YARN_APP}/1/",
        ),
        (
            "spark://m:7077",
            APP,
            {},
            {"history_server": "https://shs.example.com/", "master_ui": "http://m:8080"},
            f"https://shs.example.com/history/{APP}/",
        ),
        # local masters: the driver's UI dies with the task, and there is nothing else
        ("local[2]", "local-1767225600000", {}, {}, None),
        ("k8s://https://k8s:6443", "spark-0123", {}, {}, None),
    ],
)
def test_lasting_link(master, app_id, conf, options, link):
    assert lasting_ui_url(master, app_id, conf, **options) == link
