"""``dataframe=`` on the training operators and decorators, in real Airflow (dag.test() on SQLite, local[2]): a
callable and a templated SQL string, rank 0's value in XCom, and the errors."""

from __future__ import annotations

import pytest
from dag_runs import rendered, states, xcom

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")


def test_example_trains_on_the_rows_of_a_templated_sql_string(dags, caplog):
    run = dags["torch_dataframe_example"].test()
    assert states(run) == {"train": "success"}
    metrics = xcom(run, "train")
    assert metrics["rows"] == 2048 and metrics["shard_rows"] == 1024 and metrics["ranks"] == 2, metrics
    assert metrics["accuracy"] > 0.8, metrics
    assert "FROM range(2048)" in rendered(run, "train")["dataframe_sql"]
    assert "trained 5 epochs on 2048 rows: accuracy=" in caplog.text  # rank 0's line, in the task log


def test_a_callable_builds_the_dataframe_in_the_tasks_session(dags):
    run = dags["hvd_dataframe_callable"].test()
    assert states(run) == {"sum_squares": "success"}
    # rank 0's value: 10 rows in 3 partitions, 5 to each rank, the squares 0..81 summed over both ranks
    assert xcom(run, "sum_squares") == {"rank": 0, "rows": 10, "total": 2 * 285, "shard_rows": 5}


def test_bad_sql_and_a_callable_without_a_dataframe_fail_naming_the_task(dags, caplog, capsys):
    run = dags["dataframe_errors"].test()
    assert states(run) == {"bad_sql": "failed", "no_dataframe": "failed"}
    task_log = capsys.readouterr().out + caplog.text
    assert "Task 'bad_sql': the dataframe= SQL failed in the task's Spark session" in task_log, task_log[-5000:]
    assert "SQL: SELECT x FROM no_such_table" in task_log, task_log[-5000:]
    assert "Task 'no_dataframe': dataframe=not_a_dataframe returned a list, not a Spark DataFrame" in task_log


def test_a_dataframe_on_a_local_run_is_refused_when_the_dag_is_parsed():
    from airflow.sdk import DAG, task

    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator
    from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

    with pytest.raises(ValueError, match=r"Task 't': dataframe= needs a job on Spark.*use np=2 \(np>0\)"):
        HorovodRunnerOperator(task_id="t", python_callable=print, np=-2, dataframe="SELECT 1")
    with pytest.raises(ValueError, match="Task 't': dataframe= needs a job on Spark.*pass local_mode=False"):
        TorchDistributorOperator(task_id="t", python_callable=print, num_processes=2, dataframe="SELECT 1")
    with pytest.raises(TypeError, match="give op_kwargs instead of op_args"):
        HorovodRunnerOperator(task_id="t", python_callable=print, op_args=[1], np=2, dataframe="SELECT 1")
    with pytest.raises(TypeError, match="dataframe= takes a SQL string or a callable"):
        HorovodRunnerOperator(task_id="t", python_callable=print, np=2, dataframe=42)
    with DAG("refused", schedule=None), pytest.raises(ValueError, match="pass local_mode=False"):

        @task.torch_distributed(num_processes=2, use_gpu=False, dataframe=lambda spark: spark.range(4))
        def train() -> None: ...

        train()
