"""HorovodRunnerOperator with driver_log_verbosity="all": every line each rank prints reaches the task log."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator


def allreduce_average(values: list[float]) -> dict:
    import horovod.torch as hvd
    import torch

    hvd.init()
    mine = torch.tensor([values[hvd.rank()]])
    print(f"rank {hvd.rank()} of {hvd.size()} holds {mine.item()}")
    average = hvd.allreduce(mine, name="avg").item()
    print(f"rank {hvd.rank()} sees the average {average}")
    return {"average": average, "size": hvd.size()}


with DAG(
    dag_id="horovod_operator_example",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["horovod", "example"],
):
    HorovodRunnerOperator(
        task_id="allreduce",
        python_callable=allreduce_average,
        op_kwargs={"values": [1.0, 3.0]},
        np=2,
        driver_log_verbosity="all",
    )
