"""Distributed deep learning with Horovod, launched on Spark, driven from Airflow.

``HorovodRunner`` and ``log_to_driver`` work without Airflow; ``horovod_task`` needs it.
"""

from __future__ import annotations

from typing import Any

from . import runner
from .runner import (
    HorovodRunner,
    HorovodRunnerError,
    LaunchError,
    RankFailedError,
    RunCancelledError,
    log_to_driver,
)

__version__ = "0.1.0"

__all__ = [*runner.__all__, "horovod_task"]


def __getattr__(name: str) -> Any:
    if name == "horovod_task":  # imported lazily: it needs Airflow, the rest does not
        from .decorators.horovod import horovod_task

        return horovod_task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
