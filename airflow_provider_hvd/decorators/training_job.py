"""The TaskFlow form shared by the training operators: ``@task.horovod``, ``@task.torch_distributed``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory


class DecoratedTrainingOperator(DecoratedOperator):
    """Mixed in before a ``TrainingJobOperator`` subclass: the decorated function is its ``python_callable``."""

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


def training_task(
    decorated_operator_class: type[DecoratedTrainingOperator],
    python_callable: Callable[..., Any] | None,
    multiple_outputs: bool | None,
    **kwargs: Any,
) -> TaskDecorator:
    """A task decorator that makes ``decorated_operator_class`` tasks of the functions it decorates."""
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=decorated_operator_class,
        **kwargs,
    )
