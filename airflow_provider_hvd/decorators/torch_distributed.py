"""``@torch_distributed_task`` / ``@task.torch_distributed``: the TaskFlow form of TorchDistributorOperator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow.sdk.bases.decorator import TaskDecorator

from airflow_provider_hvd.decorators.training_job import DecoratedTrainingOperator, training_task
from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator


class _TorchDecoratedOperator(DecoratedTrainingOperator, TorchDistributorOperator):  # type: ignore[misc]  # op_args' types
    custom_operator_name = "@task.torch_distributed"
    template_fields = TorchDistributorOperator.template_fields
    template_fields_renderers = TorchDistributorOperator.template_fields_renderers


def torch_distributed_task(
    python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None, **kwargs: Any
) -> TaskDecorator:
    """Turn a torch.distributed training function into a task that runs it on ``num_processes`` processes
    (TorchDistributorOperator's arguments: ``num_processes``, ``local_mode``, ``use_gpu``, ``conn_id``...).

    The function is shipped with cloudpickle, by value; rank 0's return value is the task's XCom.

        @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False)
        def train(epochs: int) -> dict: ...
    """
    return training_task(_TorchDecoratedOperator, python_callable, multiple_outputs, **kwargs)
