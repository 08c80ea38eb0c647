"""Hugging Face's Trainer and Lightning on 2 ranks with the provider's callbacks (airflow_provider_hvd.integrations):
on this host, and as Airflow tasks (dag.test()) on the standalone cluster whose first try loses rank 0 after a
checkpoint: the curve in the task state store and in a real MLflow run, the checkpoint reported, and the retry
resuming from it, ending with the uninterrupted run's step count and its curve going on from the checkpoint; and
docs/frameworks.md's examples, each run as the script it is.

Each rank imports its framework (seconds of CPU): one run per framework and case, read by several tests."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_session
from dag_runs import states, stored, xcom
from framework_dags import KILL_AT_STEP
from framework_jobs import LOG_EVERY, MAX_STEPS, SAVE_EVERY, hf_train, lightning_train
from mlflow import MlflowClient

from airflow_provider_hvd import TorchDistributor
from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY, METRICS_KEY

pytestmark = pytest.mark.usefixtures("airflow_db")

TRAIN = {"hf": hf_train, "lightning": lightning_train}
# the checkpoint the first try reported before it was killed, and the steps its retry logs from there
RESUMED_AT = KILL_AT_STEP // SAVE_EVERY * SAVE_EVERY
AFTER_RESUMING = list(range(RESUMED_AT + LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
EXPERIMENT = "hvd-frameworks"
EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """Each framework on 2 processes of this host, never interrupted: its runner and its result."""
    out = tmp_path_factory.mktemp("uninterrupted")
    runs = {}
    for name, train in TRAIN.items():
        runner = TorchDistributor(2, local_mode=True, use_gpu=False)
        runs[name] = (runner, runner.run(train, str(out / name)))
    return runs


@pytest.fixture(scope="module")
def retried(standalone_cluster, mlflow_server, dags, tmp_path_factory) -> dict:
    """frameworks_resume on the standalone cluster (a task per framework, tracked in MLflow): each first try loses
    rank 0 at step KILL_AT_STEP, its retry resumes. The dag run, and each task's MLflow runs by try."""
    conf = {"spark.executor.cores": "1", "spark.cores.max": "2", **standalone_cluster.app_conf}
    spark = make_session(standalone_cluster.url, **conf)  # the tasks join it: one application for all their tries
    connection = json.dumps({"conn_type": "spark", "host": standalone_cluster.url, "extra": conf})
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", connection)
            run = dags["frameworks_resume"].test(
                run_conf={
                    "out": str(tmp_path_factory.mktemp("retried")),
                    "tracking_uri": mlflow_server,
                    "experiment": EXPERIMENT,
                }
            )
    finally:
        spark.stop()
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    tracked = {
        name: sorted(
            client.search_runs(
                [experiment], f"tags.`airflow.run_id` = '{run.run_id}' and tags.`airflow.task_id` = '{name}'"
            ),
            key=lambda tracked_run: int(tracked_run.data.tags["airflow.try_number"]),
        )
        for name in TRAIN
    }
    return {"run": run, "mlflow": tracked, "client": client}


def steps(series) -> list:
    return [step for step, _ in series]


@pytest.mark.parametrize("name", TRAIN)
def test_two_local_processes_train_together_and_report_their_curve_and_checkpoints(uninterrupted, name):
    runner, result = uninterrupted[name]
    assert result["global_step"] == MAX_STEPS and result["world_size"] == 2, result  # not each process alone
    assert steps(runner.metrics["loss"]) == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    assert runner.checkpoint["step"] == MAX_STEPS and runner.checkpoint["rank"] == 0, runner.checkpoint
    if name == "hf":
        assert runner.checkpoint["path"].endswith(f"/hf/checkpoint-{MAX_STEPS}") and runner.checkpoint["epoch"] == 1.5
        assert {"learning_rate", "grad_norm"} <= set(runner.metrics)
    else:
        assert runner.checkpoint["path"].endswith(f"/checkpoints/epoch=0-step={MAX_STEPS}.ckpt")
        assert runner.checkpoint["epoch"] == 0
        assert steps(runner.metrics["val_loss"]) == list(range(SAVE_EVERY, MAX_STEPS + 1, SAVE_EVERY))


@pytest.mark.parametrize("name", TRAIN)
def test_a_retry_resumes_from_the_checkpoint_and_ends_with_the_uninterrupted_step_count(retried, uninterrupted, name):
    run = retried["run"]
    assert states(run) == {"hf": "success", "lightning": "success"}
    (first, second) = retried["mlflow"][name]
    assert (first.info.status, second.info.status) == ("FAILED", "FINISHED")
    assert "rank 0 of 2 failed: was killed by SIGKILL" in first.data.tags["hvd.failure"]
    # the retry resumed from the checkpoint the first try reported (its MLflow run has it too)
    resumed_from = xcom(run, name)["resumed_from"]
    assert resumed_from == first.data.tags["hvd.checkpoint.path"]
    assert resumed_from.endswith(f"checkpoint-{RESUMED_AT}" if name == "hf" else f"step={RESUMED_AT}.ckpt")
    store = stored(run, name)
    checkpoint, metrics = store[CHECKPOINT_KEY], store[METRICS_KEY]
    # the retry's last checkpoint, at the uninterrupted run's last step; the run's own step count agrees
    assert checkpoint["try_number"] == 2 and checkpoint["step"] == MAX_STEPS and checkpoint["finished"], checkpoint
    assert checkpoint["step"] == uninterrupted[name][1]["global_step"]
    # the retry's curve goes on from the first try's checkpoint (the store keeps the latest try's)
    assert metrics["try_number"] == 2 and steps(metrics["series"]["loss"]) == AFTER_RESUMING, metrics
    client = retried["client"]
    first_curve = steps((m.step, m.value) for m in client.get_metric_history(first.info.run_id, "loss"))
    second_curve = sorted((m.step, m.value) for m in client.get_metric_history(second.info.run_id, "loss"))
    assert first_curve[: RESUMED_AT // LOG_EVERY] == list(range(LOG_EVERY, RESUMED_AT + 1, LOG_EVERY))
    assert steps(second_curve) == AFTER_RESUMING
    if name == "hf":  # the data order, the RNG and the optimizer go on where they were: the same losses
        whole = dict(uninterrupted[name][0].metrics["loss"])
        assert second_curve == [(step, pytest.approx(whole[step], rel=1e-6)) for step in AFTER_RESUMING]


@pytest.mark.parametrize(
    ("example", "returned"),
    [
        ("hf_trainer.py", {"steps": 20, "processes": 2}),
        ("lightning_ddp.py", {"steps": 32, "processes": 2}),
        ("accelerate_loop.py", {"epochs": 4, "processes": 2}),
        ("fsdp2.py", {"epochs": 4}),
    ],
)
def test_the_documented_examples_run_as_written(example, returned, tmp_path):
    """docs/frameworks.md's examples, each as the script it is; the loops (whose resuming is theirs) also resume."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / example), str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    printed = proc.stdout.splitlines()
    assert printed[0] == str(returned), printed  # together: each process alone would count its own steps
    checkpoint = printed[2].removeprefix("last checkpoint: ")
    assert Path(checkpoint).exists() and Path(checkpoint).is_relative_to(out), printed
    if "epochs" in returned:
        train = runpy.run_path(str(EXAMPLES / example))["train"]
        runner = TorchDistributor(2, local_mode=True, use_gpu=False, resume_from={"path": checkpoint, "epoch": 4})
        runner.run(train, str(out), epochs=6)
        assert steps(runner.metrics["loss"]) == [5, 6] and runner.checkpoint["path"] == str(out / "epoch-6")
