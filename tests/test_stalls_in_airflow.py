"""Stalls under Airflow (dag.test()): ``stall_timeout`` on ``@task.horovod``, and Airflow's ``execution_timeout``,
which ends the ranks as ``on_kill`` does, the task log saying where they were."""

from __future__ import annotations

import pytest
from dag_runs import states
from jobs import assert_all_gone, wait_for_pids

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")

DAG_FILE = "hvd_stall_dags.py"  # as the DAGs folder names it (a link to tests/dags/)


def test_a_stalled_task_fails_saying_where_its_ranks_were(dags, caplog, capsys):
    run = dags["hvd_stalled"].test()
    assert states(run) == {"train_until_stalled": "failed"}
    task_log = capsys.readouterr().out + caplog.text
    assert "RunStalledError" in task_log, task_log[-5000:]
    assert "no rank wrote output or reported progress for 10s (stall_timeout=10)" in task_log, task_log[-5000:]
    assert "was in wait_for_data (" in task_log and f"{DAG_FILE}, line " in task_log, task_log[-5000:]
    assert "in train_until_stalled" in task_log


def test_execution_timeout_ends_the_ranks_and_logs_where_they_were(dags, tmp_path, caplog):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = dags["hvd_execution_timeout"].test(run_conf={"pid_dir": str(pid_dir)})
    assert states(run) == {"train_past_the_timeout": "failed"}
    assert_all_gone(wait_for_pids(str(pid_dir), 2, timeout=1))
    log = caplog.text
    assert "HorovodRunner: the driver was interrupted (AirflowTaskTimeout" in log, log[-5000:]
    assert "where the ranks were (innermost frames first):" in log
    for rank in (0, 1):
        assert f"rank {rank} (quiet for " in log
    assert "was in wait_for_data (" in log and f"{DAG_FILE}, line " in log, log[-5000:]
