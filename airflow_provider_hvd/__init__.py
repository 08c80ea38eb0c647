"""Distributed deep learning with Horovod, launched on Spark, driven from Airflow.

``HorovodRunner`` and ``log_to_driver`` work without Airflow; ``HorovodHook``, ``HorovodRunnerOperator`` and
``horovod_task`` need it and are imported on first use, so that the core never imports Airflow.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import runner
from .runner import (
    HorovodRunner,
    HorovodRunnerError,
    LaunchError,
    RankFailedError,
    RunCancelledError,
    RunStalledError,
    log_to_driver,
)

__version__ = "0.1.0"

# name → module of the Airflow layer that defines it
_AIRFLOW_EXPORTS = {
    "HorovodHook": "airflow_provider_hvd.hooks.horovod",
    "HorovodRunnerOperator": "airflow_provider_hvd.operators.horovod",
    "horovod_task": "airflow_provider_hvd.decorators.horovod",
}

__all__ = [*runner.__all__, *_AIRFLOW_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _AIRFLOW_EXPORTS:
        return getattr(importlib.import_module(_AIRFLOW_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_AIRFLOW_EXPORTS})
