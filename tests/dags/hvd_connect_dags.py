"""DAGs on a Spark Connect server (a ``spark_connect`` connection), run with dag.test() and by the real deployment."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def allreduce_over_connect() -> dict:
    import horovod.torch as hvd
    import torch

    from airflow_provider_hvd import log_to_driver

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    log_to_driver(f"rank {hvd.rank()} of {hvd.size()} sums {total}")
    return {"size": hvd.size(), "sum": total}


with DAG("hvd_on_spark_connect", schedule=None, start_date=START, catchup=False):
    HorovodRunnerOperator(
        task_id="allreduce", python_callable=allreduce_over_connect, np=2, conn_id="spark_connect_default"
    )


with DAG("torch_on_spark_connect", schedule=None, start_date=START, catchup=False):

    @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False, conn_id="spark_connect_default")
    def gather_ranks() -> list:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dist.get_rank())
        dist.destroy_process_group()
        return ranks

    gather_ranks()
