"""Provider registration (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_provider_hvd import __version__


def get_provider_info() -> dict[str, Any]:
    # No "connection-types": the ``spark`` connection belongs to the apache-spark provider.
    return {
        "package-name": "airflow-provider-hvd",
        "name": "Horovod on Spark",
        "description": (
            "Distributed training with Horovod, launched as a Spark barrier job (sparkdl's HorovodRunner API)."
        ),
        "versions": [__version__],
        "integrations": [
            {"integration-name": "Horovod", "external-doc-url": "https://horovod.readthedocs.io/", "tags": ["software"]}
        ],
        "hooks": [{"integration-name": "Horovod", "python-modules": ["airflow_provider_hvd.hooks.horovod"]}],
        "operators": [{"integration-name": "Horovod", "python-modules": ["airflow_provider_hvd.operators.horovod"]}],
        "extra-links": ["airflow_provider_hvd.operators.training_job.SparkUILink"],
        "task-decorators": [{"name": "horovod", "class-name": "airflow_provider_hvd.decorators.horovod.horovod_task"}],
    }
