"""OpenLineage's parent job and transport as Spark properties of a task's session, as the apache-spark provider
passes them: OpenLineage's Spark listener then reports the Spark application as a child of the Airflow task.

Without the OpenLineage provider the helpers log that they skip, and no property is added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow.sdk import Context

#: the ``[openlineage]`` settings that the apache-spark provider's operators read, for the same parameters
PARENT_JOB_SETTING = "spark_inject_parent_job_info"
TRANSPORT_SETTING = "spark_inject_transport_info"


def inject_setting(value: bool | None, setting: str) -> bool:
    """An operator's ``openlineage_inject_*`` parameter, or where it is None, the ``[openlineage]`` setting."""
    if value is not None:
        return value
    from airflow.sdk.configuration import conf

    return bool(conf.getboolean("openlineage", setting, fallback=False))


def openlineage_properties(
    context: Context, spark_conf: Mapping[str, str], *, parent_job: bool, transport: bool
) -> dict[str, str]:
    """The ``spark.openlineage.*`` properties for the task of ``context`` that ``spark_conf`` does not already
    set (where it sets some of a kind, the user's win and none of that kind is added)."""
    if not (parent_job or transport):
        return {}
    from airflow.providers.common.compat.openlineage.utils.spark import (
        inject_parent_job_information_into_spark_properties,
        inject_transport_information_into_spark_properties,
    )

    properties = dict(spark_conf)
    if parent_job:
        properties = inject_parent_job_information_into_spark_properties(properties, context)
    if transport:
        properties = inject_transport_information_into_spark_properties(properties, context)
    return {key: str(value) for key, value in properties.items() if key not in spark_conf}
