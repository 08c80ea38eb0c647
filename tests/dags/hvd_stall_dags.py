"""DAGs for tests/test_stalls_in_airflow.py: a stalled task, and one that runs past its execution_timeout."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def wait_for_data() -> None:
    import time

    time.sleep(3600)  # a read that never returns


with DAG("hvd_execution_timeout", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):
    # np=-2 (no Spark JVM to start): the timeout must fall once the ranks run, also on a loaded machine
    @task.horovod(np=-2, execution_timeout=timedelta(seconds=40))
    def train_past_the_timeout(pid_dir: str) -> None:
        import os
        from pathlib import Path

        Path(pid_dir, f"rank-{os.environ['HOROVOD_RANK']}.pid").write_text(str(os.getpid()))
        wait_for_data()

    train_past_the_timeout(pid_dir="{{ params.pid_dir }}")


with DAG("hvd_stalled", schedule=None, start_date=START, catchup=False):

    @task.horovod(np=2, stall_timeout=timedelta(seconds=10))
    def train_until_stalled() -> None:
        print("epoch 1 done", flush=True)
        wait_for_data()

    train_until_stalled()
