"""Print the state of a DAG's latest run and a task's ``return_value`` XCom (rank 0's result)."""

from __future__ import annotations

import sys

from airflow.models import DagRun
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select


def main(dag_id: str, task_id: str) -> int:
    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc())).first()
        if run is None:
            print(f"no run of {dag_id}", file=sys.stderr)
            return 1
        row = session.scalars(
            XComModel.get_many(run_id=run.run_id, dag_ids=dag_id, task_ids=task_id, key="return_value")
        ).first()
        print(f"\nDag run {run.run_id}: {run.state}")
        print(
            f"Rank 0's result (XCom return_value of {task_id!r}): {XComModel.deserialize_value(row) if row else None}"
        )
        return 0 if run.state == "success" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
