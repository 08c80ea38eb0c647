"""Distributed deep learning with Horovod or torch.distributed, launched on Spark, driven from Airflow.

``HorovodRunner``, ``TorchDistributor``, ``attach`` (a submitted run's ``Job``), ``log_to_driver``, the
progress API (``log_metrics``, ``report_checkpoint``, ``last_checkpoint``) and a rank's DataFrame shard
(``dataframe_shard``, ``get_spark_partition_data_loader``) work without Airflow; ``HorovodHook``,
``HorovodRunnerOperator``, ``TorchDistributorOperator``, ``horovod_task`` and ``torch_distributed_task`` need it.
Every name is imported on first use: importing the package (as Airflow does to discover the provider) imports
neither Airflow nor Horovod, torch or pyspark.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name → the module that defines it
_EXPORTS = {
    "HorovodRunner": "airflow_provider_hvd.runner.runner",
    "TorchDistributor": "airflow_provider_hvd.runner.torch_distributor",
    "CauseKind": "airflow_provider_hvd.runner.errors",
    "HorovodRunnerError": "airflow_provider_hvd.runner.errors",
    "HostSlotError": "airflow_provider_hvd.runner.errors",
    "JobNotFoundError": "airflow_provider_hvd.runner.errors",
    "Job": "airflow_provider_hvd.runner.jobs",
    "JobStatus": "airflow_provider_hvd.runner.jobs",
    "attach": "airflow_provider_hvd.runner.jobs",
    "LaunchError": "airflow_provider_hvd.runner.errors",
    "RankFailedError": "airflow_provider_hvd.runner.errors",
    "RunCancelledError": "airflow_provider_hvd.runner.errors",
    "RunDetachedError": "airflow_provider_hvd.runner.errors",
    "RunStalledError": "airflow_provider_hvd.runner.errors",
    "log_to_driver": "airflow_provider_hvd.runner.rank.control",
    "log_metrics": "airflow_provider_hvd.runner.rank.progress",
    "report_checkpoint": "airflow_provider_hvd.runner.rank.progress",
    "last_checkpoint": "airflow_provider_hvd.runner.rank.progress",
    "DataFrameShard": "airflow_provider_hvd.runner.rank.dataframe",
    "dataframe_shard": "airflow_provider_hvd.runner.rank.dataframe",
    "get_spark_partition_data_loader": "airflow_provider_hvd.runner.rank.partition_loader",
    "HorovodHook": "airflow_provider_hvd.hooks.horovod",
    "HorovodRunnerOperator": "airflow_provider_hvd.operators.horovod",
    "horovod_task": "airflow_provider_hvd.decorators.horovod",
    "TorchDistributorOperator": "airflow_provider_hvd.operators.torch_distributor",
    "torch_distributed_task": "airflow_provider_hvd.decorators.torch_distributed",
}

__all__ = [
    "CauseKind",
    "DataFrameShard",
    "HorovodHook",
    "HorovodRunner",
    "HorovodRunnerError",
    "HorovodRunnerOperator",
    "HostSlotError",
    "Job",
    "JobNotFoundError",
    "JobStatus",
    "LaunchError",
    "RankFailedError",
    "RunCancelledError",
    "RunDetachedError",
    "RunStalledError",
    "TorchDistributor",
    "TorchDistributorOperator",
    "attach",
    "dataframe_shard",
    "get_spark_partition_data_loader",
    "horovod_task",
    "last_checkpoint",
    "log_metrics",
    "log_to_driver",
    "report_checkpoint",
    "torch_distributed_task",
]

if TYPE_CHECKING:
    from airflow_provider_hvd.decorators.horovod import horovod_task
    from airflow_provider_hvd.decorators.torch_distributed import torch_distributed_task
    from airflow_provider_hvd.hooks.horovod import HorovodHook
    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator
    from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator
    from airflow_provider_hvd.runner.errors import (
        CauseKind,
        HorovodRunnerError,
        JobNotFoundError,
        LaunchError,
        RankFailedError,
        RunCancelledError,
        RunDetachedError,
        RunStalledError,
    )
    from airflow_provider_hvd.runner.jobs import Job, JobStatus, attach
    from airflow_provider_hvd.runner.rank.control import log_to_driver
    from airflow_provider_hvd.runner.rank.dataframe import DataFrameShard, dataframe_shard
    from airflow_provider_hvd.runner.rank.partition_loader import get_spark_partition_data_loader
    from airflow_provider_hvd.runner.rank.progress import last_checkpoint, log_metrics, report_checkpoint
    from airflow_provider_hvd.runner.runner import HorovodRunner
    from airflow_provider_hvd.runner.torch_distributor import TorchDistributor


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
