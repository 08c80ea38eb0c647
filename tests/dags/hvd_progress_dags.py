"""DAGs of the long-run tests (tests/test_long_runs_deployment.py): progress as data, resume on retry."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task
from progress_jobs import train_resumable

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG(
    "hvd_resume",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"ckpt_dir": "", "fail_after_epoch": 0, "epochs": 6, "epoch_pause_s": 0.0, "hold_until": ""},
):

    @task.horovod(np=2, retries=1, retry_delay=timedelta(seconds=1))
    def train(
        ckpt_dir: str, fail_after_epoch: str, epochs: str, epoch_pause_s: str, hold_until: str, try_number: str
    ) -> dict:
        """2 ranks, checkpointing every epoch; the first try fails after epoch ``fail_after_epoch`` and the retry
        resumes from its checkpoint. ``train_resumable`` is in progress_jobs.py beside this file: not installed,
        it travels with the job."""
        return train_resumable(
            ckpt_dir,
            epochs=int(epochs),
            fail_after_epoch=int(fail_after_epoch) if int(try_number) == 1 else 0,
            epoch_pause_s=float(epoch_pause_s),
            hold_until=hold_until,
        )

    train(
        ckpt_dir="{{ params.ckpt_dir }}",
        fail_after_epoch="{{ params.fail_after_epoch }}",
        epochs="{{ params.epochs }}",
        epoch_pause_s="{{ params.epoch_pause_s }}",
        hold_until="{{ params.hold_until }}",
        try_number="{{ ti.try_number }}",
    )
