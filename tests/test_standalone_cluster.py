"""The same job on a real Spark standalone cluster: master + 2 workers of 1 core each, on loopback."""

from __future__ import annotations

import os

import pytest
from conftest import make_session
from jobs import train_linear
from test_big_payload import BIG, digests, expected
from test_rank_logs import progress_bar_and_messages

from airflow_provider_hvd import HorovodRunner


@pytest.fixture(scope="module")
def cluster_session(standalone_cluster):
    spark = make_session(
        standalone_cluster.url, **{"spark.executor.cores": "1", "spark.cores.max": "2", **standalone_cluster.app_conf}
    )
    yield spark
    spark.stop()


def test_ranks_land_on_two_executors_and_train(cluster_session):
    result = HorovodRunner(np=2).run(train_linear)
    assert result["final_loss"] < 0.01
    assert result["weights"][0] == result["weights"][1]
    executor_dirs = {os.path.basename(cwd) for cwd in result["cwds"]}
    assert len(executor_dirs) == 2, f"both ranks ran in one executor: {result['cwds']}"
    assert all("app-" in cwd for cwd in result["cwds"]), result["cwds"]


def test_a_200_mb_argument_arrives_intact_on_both_executors(cluster_session):
    blob = os.urandom(BIG)
    assert HorovodRunner(np=2).run(digests, blob=blob) == expected(blob, 2)


def test_executor_logs_keep_unrelayed_lines_and_never_show_a_marker(cluster_session, standalone_cluster, caplog):
    caplog.set_level("INFO", logger="airflow_provider_hvd")
    HorovodRunner(np=2).run(progress_bar_and_messages)
    app = cluster_session.sparkContext.applicationId
    executor_stderr = "".join(path.read_text() for path in standalone_cluster.workdir.glob(f"worker-*/{app}/*/stderr"))
    assert "[rank 0] training 50%" in executor_stderr and "[rank 1] training 90%" in executor_stderr
    assert "[rank 1] checkpoint at 90% ✓" in executor_stderr  # relayed, and kept in the executor's log too
    assert "hvd-log" not in executor_stderr and "\x1e" not in executor_stderr
