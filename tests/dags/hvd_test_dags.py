"""DAGs the tests run with dag.test() (Airflow 3 re-reads DAGs from the DAGs folder)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("hvd_multiple_outputs", schedule=None, start_date=START, catchup=False, params={"np": 2}):

    @task.horovod(np="{{ params.np }}", multiple_outputs=True)
    def train(run_tag: str, run_id: str | None = None) -> dict:
        import horovod.torch as hvd

        hvd.init()
        return {"size": hvd.size(), "tag": run_tag, "run_id": run_id}

    train(run_tag="{{ dag.dag_id }}")


with DAG("hvd_bad_xcom", schedule=None, start_date=START, catchup=False):

    @task.horovod(np=-2)
    def unstorable():
        import torch

        return torch.nn.Linear(2, 1)  # the model itself, not its path

    unstorable()


with DAG("hvd_on_kill", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):

    @task.horovod(np=2)
    def train_forever(pid_dir: str) -> None:
        import os
        import time
        from pathlib import Path

        import horovod.torch as hvd

        hvd.init()
        Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
        time.sleep(300)

    train_forever(pid_dir="{{ params.pid_dir }}")
