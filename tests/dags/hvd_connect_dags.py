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


with DAG("hvd_client_address_over_connect", schedule=None, start_date=START, catchup=False):
    # the client's own address for its ranks to reach it (docs/compatibility.md, a client in a container): no
    # host of the task's run listens there (the run's host is in the cluster), so it must not reach the host
    HorovodRunnerOperator(
        task_id="allreduce",
        python_callable=allreduce_over_connect,
        np=2,
        conn_id="spark_connect_default",
        spark_conf={"spark.horovodRunner.driverHost": "192.0.2.1"},  # (TEST-NET-1: nothing here listens there)
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


with DAG("hvd_task_on_a_server_of_np_slots", schedule=None, start_date=START, catchup=False):
    # np=2 on a server of 2 task slots (tests/test_connect_airflow.py: connect_local, local[2]): the ranks fit, the
    # host of a run that outlives the task does not beside them, so the task runs as it did before durable runs

    @task.horovod(np=2, conn_id="spark_connect_default")
    def sum_over_connect() -> dict:
        return allreduce_over_connect()

    sum_over_connect()
