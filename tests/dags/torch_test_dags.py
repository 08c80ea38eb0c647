"""DAGs of TorchDistributorOperator and @task.torch_distributed that the tests run with dag.test()."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task
from helpers_beside import world_size

from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def all_reduce_average(values: list[float]) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([values[rank]])
    print(f"rank {rank} of {size} holds {mine.item()}")
    dist.all_reduce(mine)
    print(f"rank {rank} sees the average {mine.item() / size}")
    dist.destroy_process_group()
    return {"average": mine.item() / size, "size": size}


with DAG("torch_operator", schedule=None, start_date=START, catchup=False, params={"n": 2}):
    TorchDistributorOperator(
        task_id="all_reduce",
        python_callable=all_reduce_average,
        op_kwargs={"values": [1.0, 3.0]},
        num_processes="{{ params.n }}",
        local_mode=False,
        use_gpu=False,  # driver_log_verbosity: "all" by default, as PySpark relays every line
    )


with DAG("torch_on_kill", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):

    @task.torch_distributed(num_processes=2, use_gpu=False)  # local_mode=True: on this host, no Spark
    def train_forever(pid_dir: str) -> None:
        import os
        import time
        from pathlib import Path

        import torch.distributed as dist

        dist.init_process_group("gloo")
        Path(pid_dir, f"rank-{dist.get_rank()}.pid").write_text(str(os.getpid()))
        time.sleep(300)

    train_forever(pid_dir="{{ params.pid_dir }}")


def wait_for_data() -> None:
    import time

    time.sleep(3600)  # a read that never returns


with DAG("torch_stalled", schedule=None, start_date=START, catchup=False):

    @task.torch_distributed(num_processes=2, use_gpu=False, stall_timeout=timedelta(seconds=10))
    def train_until_stalled() -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        print("epoch 1 done", flush=True)
        wait_for_data()

    train_until_stalled()


with DAG("torch_helper_beside", schedule=None, start_date=START, catchup=False) as torch_helper_beside:
    TorchDistributorOperator(
        task_id="train", python_callable=world_size, num_processes=2, local_mode=True, use_gpu=False
    )


if __name__ == "__main__":  # `python torch_test_dags.py`: how Airflow's docs run a DAG file to debug it
    torch_helper_beside.test()


def check_the_data(rows: int) -> None:
    if rows < 10:
        raise ValueError(f"only {rows} rows: not enough to train on")


with DAG("torch_fails_in_the_dag_file", schedule=None, start_date=START, catchup=False):

    @task.torch_distributed(num_processes=2, use_gpu=False)
    def train_on_too_little() -> None:
        check_the_data(3)

    train_on_too_little()
