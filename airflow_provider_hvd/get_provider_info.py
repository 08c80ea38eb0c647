"""Provider registration (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_provider_hvd import __version__


def get_provider_info() -> dict[str, Any]:
    # No "connection-types": ``spark`` and ``spark_connect`` belong to the apache-spark provider.
    return {
        "package-name": "airflow-provider-hvd",
        "name": "Horovod on Spark",
        "description": (
            "Distributed training with Horovod or torch.distributed, launched as a Spark barrier job (sparkdl's "
            "HorovodRunner API and PySpark's TorchDistributor API)."
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Horovod",
                "external-doc-url": "https://horovod.readthedocs.io/",
                "tags": ["software"],
            },
            {
                "integration-name": "PyTorch Distributed",
                "external-doc-url": "https://pytorch.org/docs/stable/distributed.html",
                "tags": ["software"],
            },
        ],
        "hooks": [{"integration-name": "Horovod", "python-modules": ["airflow_provider_hvd.hooks.horovod"]}],
        "operators": [
            {"integration-name": "Horovod", "python-modules": ["airflow_provider_hvd.operators.horovod"]},
            {
                "integration-name": "PyTorch Distributed",
                "python-modules": ["airflow_provider_hvd.operators.torch_distributor"],
            },
        ],
        "triggers": [{"integration-name": "Horovod", "python-modules": ["airflow_provider_hvd.triggers.training_job"]}],
        "extra-links": [
            "airflow_provider_hvd.operators.training_job.SparkUILink",
            "airflow_provider_hvd.operators.training_job.MlflowRunLink",
        ],
        # the Training tab: its `airflow.plugins` entry point loads it; Airflow reads this declaration only with
        # [core] lazy_discover_providers = False, then skips it as the plugin already loaded (docs/guide/provider.md)
        "plugins": [
            {"name": "hvd_training", "plugin-class": "airflow_provider_hvd.plugins.training_tab.TrainingTabPlugin"}
        ],
        "task-decorators": [
            {"name": "horovod", "class-name": "airflow_provider_hvd.decorators.horovod.horovod_task"},
            {
                "name": "torch_distributed",
                "class-name": "airflow_provider_hvd.decorators.torch_distributed.torch_distributed_task",
            },
        ],
    }
