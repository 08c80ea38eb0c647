"""What the modules that run DAGs with ``dag.test()`` share besides conftest's fixtures (``airflow_db``,
``spark_default_local``, ``dags``): the ``local[2]`` connection, each task's state, its XComs, its rendered
fields and what it left in the task state store."""

from __future__ import annotations

import json
import os
import signal
import threading

from jobs import wait_for_pids

LOCAL2 = json.dumps({"conn_type": "spark", "host": "local[2]"})


def states(run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in run.get_task_instances()}


def xcom(run, task_id: str, key: str = "return_value"):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key=key)
        ).first()
        return XComModel.deserialize_value(row) if row is not None else None


def rendered(run, task_id: str) -> dict:
    """The task's rendered template fields as Airflow keeps them (the UI's "Rendered Template")."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields as Rendered
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalars(
            select(Rendered.rendered_fields).where(
                Rendered.dag_id == run.dag_id, Rendered.run_id == run.run_id, Rendered.task_id == task_id
            )
        ).one()


def stored(run, task_id: str) -> dict:
    from airflow.models.task_state_store import TaskStateStoreModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(TaskStateStoreModel.key, TaskStateStoreModel.value).where(
                TaskStateStoreModel.dag_id == run.dag_id,
                TaskStateStoreModel.run_id == run.run_id,
                TaskStateStoreModel.task_id == task_id,
            )
        ).all()
    return {row.key: json.loads(row.value) for row in rows}


def killed_once_training(dag, pid_dir: str, ranks: int = 2):
    """Run ``dag`` (conf ``pid_dir``), sending this process SIGTERM once ``ranks`` rank processes wrote their pid
    there: what Airflow's supervisor sends on a kill; the task runner calls ``on_kill()``."""

    def kill_when_training() -> None:
        wait_for_pids(pid_dir, ranks)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_when_training)
    killer.start()
    try:
        return dag.test(run_conf={"pid_dir": pid_dir})
    finally:
        killer.join()
