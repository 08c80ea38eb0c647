"""What the modules that run DAGs with ``dag.test()`` share besides conftest's fixtures (``airflow_db``,
``spark_default_local``, ``dags``): the ``local[2]`` connection and each task's state."""

from __future__ import annotations

import json

LOCAL2 = json.dumps({"conn_type": "spark", "host": "local[2]"})


def states(run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in run.get_task_instances()}
