"""The core runner: no Airflow in here. Its modules are grouped by the process they run in: ``driver/``,
``agent/``, ``reaper``, ``rank/``, and ``shared/`` for all of them; docs/internals.md lists each module, the
threads and the timings."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CauseKind,
    HorovodRunnerError,
    HostSlotError,
    JobNotFoundError,
    LaunchError,
    RankFailedError,
    RunCancelledError,
    RunDetachedError,
    RunStalledError,
)

if TYPE_CHECKING:
    from .jobs import Job, JobStatus, attach
    from .rank.control import log_to_driver
    from .rank.dataframe import DataFrameShard, dataframe_shard
    from .rank.partition_loader import get_spark_partition_data_loader
    from .rank.progress import last_checkpoint, log_metrics, report_checkpoint
    from .runner import HorovodRunner
    from .torch_distributor import TorchDistributor

# imported on first use: a rank process (which imports log_to_driver) does not load the driver's modules
_LAZY = {
    "HorovodRunner": ".runner",
    "TorchDistributor": ".torch_distributor",
    "Job": ".jobs",
    "JobStatus": ".jobs",
    "attach": ".jobs",
    "log_to_driver": ".rank.control",
    "log_metrics": ".rank.progress",
    "report_checkpoint": ".rank.progress",
    "last_checkpoint": ".rank.progress",
    "DataFrameShard": ".rank.dataframe",
    "dataframe_shard": ".rank.dataframe",
    "get_spark_partition_data_loader": ".rank.partition_loader",
}

__all__ = [
    "CauseKind",
    "DataFrameShard",
    "HorovodRunner",
    "HorovodRunnerError",
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
    "attach",
    "dataframe_shard",
    "get_spark_partition_data_loader",
    "last_checkpoint",
    "log_metrics",
    "log_to_driver",
    "report_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
