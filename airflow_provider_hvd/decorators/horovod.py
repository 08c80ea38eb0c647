"""``@horovod_task`` / ``@task.horovod``: the TaskFlow form of HorovodRunnerOperator."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator


class _HorovodDecoratedOperator(DecoratedOperator, HorovodRunnerOperator):  # type: ignore[misc]  # op_args' types
    custom_operator_name = "@task.horovod"
    template_fields = HorovodRunnerOperator.template_fields
    template_fields_renderers = HorovodRunnerOperator.template_fields_renderers

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            kwargs_to_upstream={"python_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs},
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )


def horovod_task(
    python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None, **kwargs: Any
) -> TaskDecorator:
    """Turn a training function into a task that runs it on Horovod ranks (HorovodRunnerOperator's arguments).

    The function is shipped to the ranks with cloudpickle, by value (DAG files are imported under names
    that executors cannot import); rank 0's return value is the task's XCom.

        @task.horovod(np=2, conn_id="spark_default")
        def train(epochs: int) -> dict: ...
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_HorovodDecoratedOperator,
        **kwargs,
    )
