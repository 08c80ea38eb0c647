"""OpenLineage's parent job and transport in the Spark session of a training task, as the apache-spark provider's
operators pass them: Spark's own record of the session's settings, against the events Airflow's OpenLineage
listener sent for the same task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")

API_KEY = "ol-s3cret"


@pytest.fixture
def lineage_backend():
    """An OpenLineage HTTP backend on loopback: the events it received, and its URL."""
    events: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            events.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, name="lineage-backend")
    thread.start()
    try:
        yield events, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def spark_settings(event_log_dir: Path) -> dict[str, dict[str, str]]:
    """Each application's Spark settings as its event log recorded them, by application name."""
    settings = {}
    for events in event_log_dir.glob("*/events_*"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerEnvironmentUpdate":
                properties = dict(event["Spark Properties"])
                settings[properties["spark.app.name"]] = properties
    return settings


def test_the_session_carries_the_tasks_parent_job_and_transport_as_configured(lineage_backend, tmp_path):
    events, url = lineage_backend
    transport = {
        "type": "http",
        "url": url,
        "endpoint": "api/v1/lineage",
        "auth": {"type": "api_key", "apiKey": API_KEY},
    }
    env = {
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "hvd-tests",
        "AIRFLOW__OPENLINEAGE__SPARK_INJECT_PARENT_JOB_INFO": "True",
        "AIRFLOW__OPENLINEAGE__SPARK_INJECT_TRANSPORT_INFO": "True",
    }
    # `airflow dags test` (dag.test()) in a process of its own: the OpenLineage provider reads its settings once
    # per process, and must read these before Airflow loads its listener
    event_log = tmp_path / "event-log"
    event_log.mkdir()
    airflow = Path(sys.executable).with_name("airflow")
    dag_test = [
        str(airflow),
        "dags",
        "test",
        "hvd_openlineage",
        "--conf",
        json.dumps({"event_log_dir": str(event_log)}),
    ]
    done = subprocess.run(
        dag_test, env={**os.environ, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    task_log = done.stdout + done.stderr
    assert done.returncode == 0, task_log[-3000:]
    assert "success" in task_log and API_KEY not in task_log  # the API key masked where the settings are logged

    settings = spark_settings(event_log)
    configured = settings["hvd_openlineage.lineage_as_configured"]
    started = {
        event["job"]["name"]: event["run"]["runId"]
        for event in events
        if event["eventType"] == "START" and event["job"]["namespace"] == "hvd-tests"
    }
    dag_run = next(event["run"]["runId"] for event in events if event["job"]["name"] == "hvd_openlineage")
    # the Spark application's parent is the task's run that OpenLineage reported, its root the DAG run's
    assert {key: value for key, value in configured.items() if key.startswith("spark.openlineage.")} == {
        "spark.openlineage.parentJobNamespace": "hvd-tests",
        "spark.openlineage.parentJobName": "hvd_openlineage.lineage_as_configured",
        "spark.openlineage.parentRunId": started["hvd_openlineage.lineage_as_configured"],
        "spark.openlineage.rootParentJobNamespace": "hvd-tests",
        "spark.openlineage.rootParentJobName": "hvd_openlineage",
        "spark.openlineage.rootParentRunId": dag_run,
        "spark.openlineage.transport.type": "http",
        "spark.openlineage.transport.url": url,
        "spark.openlineage.transport.endpoint": "api/v1/lineage",
        "spark.openlineage.transport.timeoutInMillis": "5000",
        "spark.openlineage.transport.auth.type": "api_key",
        "spark.openlineage.transport.auth.apiKey": f"Bearer {API_KEY}",
    }
    # the operator's parameters win over the [openlineage] settings: off, the session has none
    off = settings["hvd_openlineage.lineage_off"]
    assert off["spark.eventLog.enabled"] == "true"
    assert not [key for key in off if key.startswith("spark.openlineage.")]
