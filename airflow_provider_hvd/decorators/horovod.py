"""``@horovod_task`` / ``@task.horovod``: the TaskFlow form of HorovodRunnerOperator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow.sdk.bases.decorator import TaskDecorator

from airflow_provider_hvd.decorators.training_job import DecoratedTrainingOperator, training_task
from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator


class _HorovodDecoratedOperator(DecoratedTrainingOperator, HorovodRunnerOperator):  # type: ignore[misc]  # op_args' types
    custom_operator_name = "@task.horovod"
    template_fields = HorovodRunnerOperator.template_fields
    template_fields_renderers = HorovodRunnerOperator.template_fields_renderers


def horovod_task(
    python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None, **kwargs: Any
) -> TaskDecorator:
    """Turn a training function into a task that runs it on Horovod ranks (HorovodRunnerOperator's arguments).

    The function is shipped to the ranks with cloudpickle, by value (DAG files are imported under names
    that executors cannot import); rank 0's return value is the task's XCom.

        @task.horovod(np=2, conn_id="spark_default")
        def train(epochs: int) -> dict: ...
    """
    return training_task(_HorovodDecoratedOperator, python_callable, multiple_outputs, **kwargs)
