"""DAGs with ``dataframe=`` that the tests run with dag.test(): a callable on HorovodRunnerOperator (on classic
Spark, and over Spark Connect), and the errors of a bad SQL string and of a callable that returns no DataFrame."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def squares(spark):
    """The task's session's DataFrame: ``n`` and ``n * n`` for 10 rows, in 3 partitions (not one per rank)."""
    spark.range(10, numPartitions=3).selectExpr("id AS n", "id * id AS square").createOrReplaceTempView("squares")
    return spark.table("squares")


def sum_shards(scale: int) -> dict:
    """Each rank sums its shard's ``square`` column; Horovod adds the sums up."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_hvd import dataframe_shard

    hvd.init()
    shard = dataframe_shard()
    mine = sum(int(batch["square"].sum()) for batch in shard.iter_batches(4))
    total = hvd.allreduce(torch.tensor([mine, shard.num_rows]), op=hvd.Sum)
    return {"rank": hvd.rank(), "rows": int(total[1]), "total": int(total[0]) * scale, "shard_rows": shard.num_rows}


with DAG("hvd_dataframe_callable", schedule=None, start_date=START, catchup=False):
    HorovodRunnerOperator(
        task_id="sum_squares", python_callable=sum_shards, op_kwargs={"scale": 2}, np=2, dataframe=squares
    )


with DAG("hvd_dataframe_over_connect", schedule=None, start_date=START, catchup=False):  # test_connect_airflow.py
    HorovodRunnerOperator(
        task_id="sum_squares",
        python_callable=sum_shards,
        op_kwargs={"scale": 2},
        np=2,
        dataframe=squares,
        conn_id="spark_connect_default",
    )


def not_a_dataframe(spark):
    return [1, 2, 3]


with DAG("dataframe_errors", schedule=None, start_date=START, catchup=False, params={"table": "no_such_table"}):

    @task.torch_distributed(
        num_processes=2, local_mode=False, use_gpu=False, dataframe="SELECT x FROM {{ params.table }}"
    )
    def bad_sql() -> None: ...

    @task.horovod(np=2, dataframe=not_a_dataframe)
    def no_dataframe() -> None: ...

    bad_sql()
    no_dataframe()
