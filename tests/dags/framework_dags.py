"""DAGs of tests/test_frameworks.py: Hugging Face's Trainer and Lightning with the provider's callbacks, each try's
rank 0 killed after a checkpoint on the first try, the retry resuming from it (framework_jobs.py beside this file)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task
from framework_jobs import hf_train, lightning_train

START = pendulum.datetime(2026, 1, 1, tz="UTC")
KILL_AT_STEP = 6  # after the checkpoint of step 4
TRACKING = {"tracking_uri": "{{ params.tracking_uri }}", "experiment_name": "{{ params.experiment }}"}

with DAG(
    "frameworks_resume",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"out": "", "tracking_uri": "", "experiment": ""},
):
    retried = {"retries": 1, "retry_delay": timedelta(0), "mlflow": TRACKING}

    @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False, **retried)
    def hf(out: str) -> dict:
        return hf_train(f"{out}/hf", kill_at_step=KILL_AT_STEP)

    @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False, **retried)
    def lightning(out: str) -> dict:
        return lightning_train(f"{out}/lightning", kill_at_step=KILL_AT_STEP)

    hf(out="{{ params.out }}")
    lightning(out="{{ params.out }}")
