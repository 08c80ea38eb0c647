"""DAGs the tests run with dag.test() (Airflow 3 re-reads DAGs from the DAGs folder)."""

from __future__ import annotations

from datetime import timedelta

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


with DAG("hvd_bad_xcom", schedule=None, start_date=START, catchup=False, params={"marks": ""}):

    @task.horovod(np=-2, retries=2, retry_delay=timedelta(0))
    def unstorable(marks: str):
        """Trains (rank 0 marks it in ``marks``/trained, reports a checkpoint), then returns what no XCom holds."""
        import os
        from pathlib import Path

        import torch

        from airflow_provider_hvd import report_checkpoint

        if os.environ["HOROVOD_RANK"] == "0":
            with open(Path(marks, "trained"), "a") as trained:
                trained.write("trained\n")
            report_checkpoint(str(Path(marks, "model.pt")), epoch=1)
        return torch.nn.Linear(2, 1)  # the model itself, not its path

    unstorable(marks="{{ params.marks }}")


with DAG("hvd_restarts", schedule=None, start_date=START, catchup=False, params={"marks": ""}):

    @task.horovod(np=-2, max_restarts=1)
    def killed_once(marks: str) -> dict:
        """Rank 0 reports a checkpoint, then rank 1's process is SIGKILLed, in the first attempt only; the second
        attempt returns what it resumed from."""
        import os
        import signal
        import time
        from pathlib import Path

        from airflow_provider_hvd import last_checkpoint, report_checkpoint

        resumed = last_checkpoint()
        if resumed is None:
            if os.environ["HOROVOD_RANK"] == "0":
                report_checkpoint(str(Path(marks, "model.pt")), epoch=1)
                Path(marks, "reported").touch()
            else:
                while not Path(marks, "reported").exists():
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        print(f"resumed from epoch {resumed['epoch']}", flush=True)
        return resumed

    killed_once(marks="{{ params.marks }}")


with DAG("hvd_on_kill_early", schedule=None, start_date=START, catchup=False, params={"pid_dir": ""}):

    @task.horovod(np=2, openlineage_inject_parent_job_info=True)
    def train_briefly(pid_dir: str) -> None:
        """Each rank writes its pid and returns: the task is killed before the ranks start (tests)."""
        import os
        from pathlib import Path

        Path(pid_dir, f"rank-{os.environ['HOROVOD_RANK']}.pid").write_text(str(os.getpid()))

    train_briefly(pid_dir="{{ params.pid_dir }}")


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
