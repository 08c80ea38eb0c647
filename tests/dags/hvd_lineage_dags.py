"""A DAG whose Spark sessions record their settings (Spark's event log): OpenLineage's properties in them."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

# Spark's own record of the session's settings (SparkListenerEnvironmentUpdate), read after the run
EVENT_LOG = {
    "spark.eventLog.enabled": "true",
    "spark.eventLog.dir": "{{ params.event_log_dir }}",
    "spark.eventLog.compress": "false",
    "spark.ui.enabled": "false",
}

with DAG(
    "hvd_openlineage",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"event_log_dir": ""},
):

    @task.horovod(np=1, spark_conf=EVENT_LOG)
    def lineage_as_configured() -> int:
        return 1

    @task.horovod(
        np=1, spark_conf=EVENT_LOG, openlineage_inject_parent_job_info=False, openlineage_inject_transport_info=False
    )
    def lineage_off() -> int:
        return 1

    lineage_as_configured() >> lineage_off()
