"""Real Airflow (dag.test() on SQLite): the example DAGs, XComs, the task log, on_kill, a standalone cluster."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from dag_runs import LOCAL2, killed_once_training, states, stored, xcom
from jobs import assert_all_gone, wait_for_pids
from rank_lines import tagged_lines

from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")


def test_decorator_example_trains_and_reports(dags, caplog, capsys):
    run = dags["horovod_train_example"].test()
    assert states(run) == {"prepare_data": "success", "train": "success", "report": "success"}
    metrics = xcom(run, "train")
    assert metrics["ranks"] == 2 and metrics["epochs"] == 8 and metrics["accuracy"] > 0.9
    assert len(metrics["hosts"]) == 2  # where each rank ran (local[2]: this host, twice)
    relayed = tagged_lines(caplog.records)
    assert relayed[0].startswith("[rank 0] epoch 1/8: loss=") and relayed[-1].startswith("[rank 0] epoch 8/8: loss=")
    assert f"rank 0 result: {metrics}" in capsys.readouterr().out


def test_operator_example_relays_every_line(dags, caplog):
    run = dags["horovod_operator_example"].test()
    assert states(run) == {"allreduce": "success"}
    assert xcom(run, "allreduce") == {"average": 2.0, "size": 2}
    assert not xcom(run, "allreduce", "_link_SparkUILink")  # local[2]: no page outlives the task, so no link
    relayed = set(tagged_lines(caplog.records))
    assert {r.levelno for r in caplog.records if r.name == "airflow_provider_hvd.ranks"} == {logging.INFO}
    assert relayed == {
        "[rank 0] rank 0 of 2 holds 1.0",
        "[rank 0] rank 0 sees the average 2.0",
        "[rank 1] rank 1 of 2 holds 3.0",
        "[rank 1] rank 1 sees the average 2.0",
    }


def test_multiple_outputs_and_templated_arguments(dags):
    run = dags["hvd_multiple_outputs"].test()
    assert states(run) == {"train": "success"}
    assert xcom(run, "train", "size") == 2
    assert xcom(run, "train", "tag") == "hvd_multiple_outputs"
    assert xcom(run, "train", "run_id") == run.run_id


def test_a_value_airflow_cannot_store_fails_once_with_advice_and_is_not_trained_again(dags, capsys, tmp_path):
    """Before: a TypeError after the training, which Airflow retries: each of the 2 retries trained again, and the
    successful training's checkpoint was not marked finished."""
    run = dags["hvd_bad_xcom"].test(run_conf={"marks": str(tmp_path)})  # retries=2
    assert states(run) == {"unstorable": "failed"}
    assert (tmp_path / "trained").read_text().splitlines() == ["trained"]  # one try, one training
    assert [ti.try_number for ti in run.get_task_instances()] == [1]
    checkpoint = stored(run, "unstorable")[CHECKPOINT_KEY]
    assert checkpoint["path"] == str(tmp_path / "model.pt") and checkpoint["finished"] is True
    task_log = capsys.readouterr().out
    assert "returned a torch.nn.modules.linear.Linear, which Airflow cannot store as an XCom" in task_log
    assert "save the object (a model, a tensor) to shared storage and return its path" in task_log
    assert "AirflowFailException" in task_log  # the task fails for good: a retry would train again


def test_a_task_with_max_restarts_restarts_a_killed_rank_within_its_try(dags, tmp_path, caplog, capsys):
    """@task.horovod(np=-2, max_restarts=1): rank 1 SIGKILLed after rank 0's checkpoint; the task succeeds in one
    try, its second attempt resumed from that checkpoint (reported by this try), its log saying the restart."""
    run = dags["hvd_restarts"].test(run_conf={"marks": str(tmp_path)})
    assert states(run) == {"killed_once": "success"}
    assert [ti.try_number for ti in run.get_task_instances()] == [1]
    resumed = xcom(run, "killed_once")
    assert resumed["path"] == str(tmp_path / "model.pt") and resumed["epoch"] == 1 and resumed["try_number"] == 1
    assert stored(run, "killed_once")[CHECKPOINT_KEY]["finished"] is True
    task_log = capsys.readouterr().out + caplog.text
    assert re.search(
        r"HorovodRunner: restart 1 of 1 after Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python "
        r"exception: resuming from \S+/model\.pt \(epoch=1\), reported by try 1",
        task_log,
    ), task_log
    assert "[rank 0, attempt 2] resumed from epoch 1" in tagged_lines(caplog.records)


def test_killed_task_fails_and_leaves_nothing_running(dags, tmp_path, caplog):
    from pyspark import SparkContext

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = killed_once_training(dags["hvd_on_kill"], str(pid_dir))
    assert states(run) == {"train_forever": "failed"}
    assert "HorovodRunner: the run was cancelled; ending 2 running rank(s)" in caplog.text
    assert_all_gone(wait_for_pids(str(pid_dir), 2, timeout=1))
    assert SparkContext._active_spark_context is None, "the task's SparkContext (and its jobs) outlived it"


def test_a_kill_while_the_openlineage_settings_are_built_ends_the_task_before_its_ranks_start(
    dags, pid_dir, monkeypatch, caplog, capsys
):
    """Before: ``on_kill`` in that window only set a flag: the whole job ran (both ranks), then the task failed."""
    from airflow_provider_hvd.operators import training_job

    killed, on_kill = threading.Event(), training_job.TrainingJobOperator.on_kill

    def on_kill_noted(self) -> None:
        on_kill(self)
        killed.set()

    def slow_lineage(*args, **kwargs) -> dict:  # OpenLineage's step takes long, and the task is killed meanwhile
        os.kill(os.getpid(), signal.SIGTERM)  # what Airflow's supervisor sends on a kill; the task runs on_kill()
        assert killed.wait(60), "on_kill() was not called"
        return {}

    monkeypatch.setattr(training_job.TrainingJobOperator, "on_kill", on_kill_noted)
    monkeypatch.setattr(training_job, "openlineage_properties", slow_lineage)
    began = time.monotonic()
    run = dags["hvd_on_kill_early"].test(run_conf={"pid_dir": pid_dir})
    took = time.monotonic() - began
    assert states(run) == {"train_briefly": "failed"}
    assert "RunCancelledError: the job was cancelled before its ranks started" in capsys.readouterr().out
    assert "ranks started" not in caplog.text and os.listdir(pid_dir) == [], "ranks ran after the task was killed"
    assert took < 60, f"the killed task took {took:.0f}s"  # no Spark session, no ranks: seconds


def test_airflow_tasks_test_from_the_command_line():
    env = {**os.environ, "AIRFLOW_CONN_SPARK_DEFAULT": LOCAL2}
    proc = subprocess.run(
        [sys.executable, "-m", "airflow", "tasks", "test", "horovod_operator_example", "allreduce"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "[rank 0] rank 0 of 2 holds 1.0" in output and "[rank 1] rank 1 sees the average 2.0" in output


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed (make setup)")
def test_tensorflow_example_trains_a_tf_keras_model(dags, caplog, capsys):
    run = dags["horovod_tensorflow_example"].test()
    assert states(run) == {"train": "success", "report": "success"}
    metrics = xcom(run, "train")
    assert metrics["ranks"] == 2 and metrics["epochs"] == 4 and metrics["accuracy"] > 0.9
    relayed = tagged_lines(caplog.records)
    assert [line.split(":")[0] for line in relayed] == [
        f"[rank 0] epoch {epoch}/4 {event}" for epoch in range(1, 5) for event in ("begin", "end")
    ]
    end = re.fullmatch(r"\[rank 0\] epoch 4/4 end: loss=([\d.]+) accuracy=([\d.]+)", relayed[-1])
    assert end and (float(end[1]), float(end[2])) == pytest.approx((metrics["loss"], metrics["accuracy"]), abs=1e-3)
    assert f"rank 0 result: {metrics}" in capsys.readouterr().out
