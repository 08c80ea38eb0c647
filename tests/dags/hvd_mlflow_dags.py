"""DAGs of the MLflow tests (tests/test_mlflow_airflow.py): one MLflow run per try, the runs of a retry linked."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")
TRACKING = {"tracking_uri": "{{ params.tracking_uri }}", "experiment_name": "{{ params.experiment }}"}
STEPS = 40

with DAG(
    "hvd_mlflow_retry", schedule=None, start_date=START, catchup=False, params={"tracking_uri": "", "experiment": ""}
):

    @task.horovod(
        np=-2, retries=1, retry_delay=timedelta(0), mlflow={**TRACKING, "tags": {"team": "vision", "attempt": "x"}}
    )
    def train(steps: int, attempt: str) -> dict:
        """Rank 0 logs a loss curve; on the first try rank 1 fails halfway, and Airflow's retry runs it all again."""
        import math

        import horovod.torch as hvd
        import torch

        from airflow_provider_hvd import log_metrics

        hvd.init()
        for step in range(1, steps + 1):
            hvd.allreduce(torch.tensor([1.0]))
            if int(attempt) == 1 and step == steps // 2 and hvd.rank() == 1:
                raise RuntimeError("rank 1 fails on the first try")
            if hvd.rank() == 0:
                log_metrics(step, loss=2.0 * math.exp(-step / 10) + 0.05 * math.sin(step))
        return {"attempt": int(attempt)}

    train(steps=STEPS, attempt="{{ ti.try_number }}")


with DAG("hvd_mlflow_on_kill", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):

    @task.horovod(np=-2, mlflow=True)
    def train_forever(pid_dir: str) -> None:
        import os
        import time
        from pathlib import Path

        import horovod.torch as hvd

        hvd.init()
        Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
        time.sleep(300)

    train_forever(pid_dir="{{ params.pid_dir }}")


def all_reduce(x: float) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([x])
    dist.all_reduce(total)
    return total.item()


with DAG(
    "torch_mlflow_mapped", schedule=None, start_date=START, catchup=False, params={"tracking_uri": "", "experiment": ""}
):
    TorchDistributorOperator.partial(
        task_id="reduce", python_callable=all_reduce, num_processes=1, use_gpu=False, mlflow=TRACKING
    ).expand(op_kwargs=[{"x": 1.5}])
