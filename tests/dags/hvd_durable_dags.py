"""DAGs whose training outlives the task (a ``spark_connect`` connection): durable by default, and deferrable;
run by the real deployment (tests/test_airflow_deployment.py); and a deferrable task refused on a classic one."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")
CONF = {"pid_dir": "{{ dag_run.conf['pid_dir'] }}", "gate": "{{ dag_run.conf['gate'] }}"}


def train_until_gate(pid_dir: str, gate: str, checkpoints: bool = False) -> dict:
    """Each rank appends its pid to rank-N.pids (a second start of a rank adds a line) and writes rank-N.pid,
    then "trains" (a line and, on rank 0, a metric a step) until the file ``gate`` exists; rank 0 returns its pid
    and its steps. With ``checkpoints``, the ranks meet each step, rank 0 reports a checkpoint (step-N.json in
    ``pid_dir``) before its metric, and a restarted attempt goes on from the last one (rank 0 says which)."""
    import json
    import os
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(Path(pid_dir, f"rank-{rank}.pids"), "a") as out:
        out.write(f"{os.getpid()}\n")
    Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))
    resumed = last_checkpoint() if checkpoints else None
    step, deadline = resumed["step"] + 1 if resumed else 0, time.monotonic() + 300
    while time.monotonic() < deadline:
        if checkpoints:  # (every rank leaves the loop at the same step)
            passed = torch.tensor([float(Path(gate).exists())])
            dist.all_reduce(passed, op=dist.ReduceOp.MAX)
            if passed.item():
                break
        elif Path(gate).exists():
            break
        print(f"rank {rank} step {step}", flush=True)
        if rank == 0 and checkpoints:
            path = Path(pid_dir, f"step-{step}.json")
            path.write_text(json.dumps({"step": step}))
            report_checkpoint(str(path), step=step)
        if rank == 0:
            log_metrics(step, loss=1.0 / (step + 1))  # the Training tab's curve, across the tries
        step += 1
        time.sleep(0.5)
    total = torch.tensor([float(step)])
    dist.all_reduce(total)
    print(f"rank {rank} passed the gate at step {step}", flush=True)
    dist.destroy_process_group()
    return {"pid": os.getpid(), "steps": step, "total": total.item(), "resumed_from": resumed}


def trainer(task_id: str, **kwargs: object) -> TorchDistributorOperator:
    settings: dict = {
        "retries": 1,
        "retry_delay": timedelta(seconds=1),
        "op_kwargs": CONF,
        "mlflow": True,  # the deployment's MLFLOW_TRACKING_URI: one MLflow run for the run, whichever try attaches
        **kwargs,
    }
    return TorchDistributorOperator(
        task_id=task_id,
        python_callable=train_until_gate,
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        conn_id="spark_connect_default",
        **settings,
    )


with DAG("durable_training", schedule=None, start_date=START, catchup=False):
    trainer("train")

with DAG("deferred_training", schedule=None, start_date=START, catchup=False):
    # a rank the test kills restarts from the last checkpoint (max_restarts), in the task's one try
    trainer("train", deferrable=True, max_restarts=1, op_kwargs={**CONF, "checkpoints": True})

with DAG("not_durable_training", schedule=None, start_date=START, catchup=False):  # benchmarks/durable_retry.py
    trainer("train", durable=False)

with DAG("durable_missed_heartbeats", schedule=None, start_date=START, catchup=False):
    # the test holds the retry back (up_for_retry) until the first try's supervisor, stopped past the deployment's
    # heartbeat timeout, has heard the server's 409 and SIGTERMed it
    trainer("train", retry_delay=timedelta(seconds=20))

LATE_POOL = "late_resume"  # 1 slot (tests/test_airflow_deployment.py makes it): deferred tasks do not hold it

with DAG("deferred_late_resume", schedule=None, start_date=START, catchup=False):
    # resumed once the pool's slot is free: later than the run's detached_timeout after the trigger detached
    trainer("train", deferrable=True, pool=LATE_POOL, detached_timeout=20)

with DAG("hold_the_pool_slot", schedule=None, start_date=START, catchup=False):

    @task(pool=LATE_POOL)
    def hold(gate: str) -> None:
        """Hold the pool's slot until the file ``gate`` exists."""
        import time
        from pathlib import Path

        while not Path(gate).exists():
            time.sleep(0.5)

    hold("{{ dag_run.conf['gate'] }}")

with DAG("deferred_execution_timeout", schedule=None, start_date=START, catchup=False):
    # trains until a gate nobody opens: the deferral times out with what is left of execution_timeout
    trainer("train", deferrable=True, execution_timeout=timedelta(seconds=90), retries=0)

with DAG("deferrable_on_classic", schedule=None, start_date=START, catchup=False):
    TorchDistributorOperator(  # on spark_default, a classic connection: refused when the task starts
        task_id="train", python_callable=print, num_processes=2, local_mode=False, use_gpu=False, deferrable=True
    )
