"""DAGs the real-deployment test (tests/test_airflow_deployment.py) triggers through the REST API."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("hvd_retry", schedule=None, start_date=START, catchup=False):

    @task.horovod(np=2, retries=1, retry_delay=timedelta(seconds=1))
    def flaky(attempt: str) -> dict:
        """Rank 1 fails on the task's first try; Airflow's retry runs the whole job again."""
        import horovod.torch as hvd

        hvd.init()
        if int(attempt) == 1 and hvd.rank() == 1:
            raise RuntimeError("rank 1 fails on the first try")
        return {"attempt": int(attempt), "size": hvd.size()}

    flaky(attempt="{{ ti.try_number }}")


with DAG("hvd_unreachable_master", schedule=None, start_date=START, catchup=False):

    @task.horovod(np=2, conn_id="spark_unreachable")
    def never_starts() -> None:
        raise AssertionError("no rank should start: the connection's master does not answer")

    never_starts()


with DAG("hvd_on_hosts", schedule=None, start_date=START, catchup=False):

    @task.horovod(np=2, conn_id="spark_hosts")
    def where_ranks_run() -> dict:
        """One rank on each namespace host (tests/hosts.py): their hostnames and an allreduce across them."""
        import socket

        import horovod.torch as hvd
        import torch

        from airflow_provider_hvd import log_to_driver

        hvd.init()
        log_to_driver(f"rank {hvd.rank()} runs on {socket.gethostname()}")
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
        return {"hosts": hvd.allgather_object(socket.gethostname()), "sum": total}

    where_ranks_run()


with DAG("torch_resume_on_retry", schedule=None, start_date=START, catchup=False, params={"ckpt_dir": ""}):

    @task.torch_distributed(
        num_processes=2, local_mode=False, use_gpu=False, retries=1, retry_delay=timedelta(seconds=1)
    )
    def train_resumable(ckpt_dir: str, attempt: str) -> dict:
        """torch.distributed processes on the cluster; rank 0 reports a checkpoint after each of 2 epochs, then, on
        the first try, rank 1 fails; the retry resumes from the last checkpoint and finishes epochs 3 and 4."""
        import os

        import torch
        import torch.distributed as dist

        from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

        dist.init_process_group("gloo")
        resumed = last_checkpoint()
        first = resumed["epoch"] + 1 if resumed else 1
        for epoch in range(first, 5):
            if int(attempt) == 1 and epoch == 3 and dist.get_rank() == 1:
                raise RuntimeError("rank 1 lost its shard on the first try")
            total = torch.tensor([1.0])
            dist.all_reduce(total)
            if dist.get_rank() == 0:
                log_metrics(epoch, loss=1.0 / epoch)
                path = os.path.join(ckpt_dir, f"epoch-{epoch}.txt")
                with open(path, "w") as out:
                    out.write(str(epoch))
                report_checkpoint(path, epoch=epoch)
        return {"resumed_from": resumed["epoch"] if resumed else None, "size": int(total.item())}

    train_resumable(ckpt_dir="{{ params.ckpt_dir }}", attempt="{{ ti.try_number }}")


with DAG("hvd_mlflow_killed_hard", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):

    @task.horovod(np=-2, retries=1, retry_delay=timedelta(seconds=1), mlflow=True)
    def lose_the_first_try(pid_dir: str, attempt: str) -> dict:
        """The first try waits to be killed hard (the test SIGKILLs the task's process, as a lost worker would be):
        its MLflow run is left RUNNING for the retry to end. ``mlflow=True``: the deployment's MLFLOW_TRACKING_URI."""
        import os
        import time
        from pathlib import Path

        import horovod.torch as hvd

        hvd.init()
        if int(attempt) == 1:
            Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
            time.sleep(300)
        return {"attempt": int(attempt)}

    lose_the_first_try(pid_dir="{{ params.pid_dir }}", attempt="{{ ti.try_number }}")
