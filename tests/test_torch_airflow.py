"""TorchDistributorOperator and @task.torch_distributed in real Airflow (dag.test() on SQLite): the example DAG,
XComs, the task log, the task state store, on_kill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dag_runs import killed_once_training, states, stored, xcom
from jobs import assert_all_gone, wait_for_pids

from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY, METRICS_KEY

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")


def relayed_text(caplog) -> str:
    """What the ranks' logger logged, as the task log shows it."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "airflow_provider_hvd.ranks")


def test_ddp_example_trains_on_two_processes_and_reports(dags, caplog, capsys):
    run = dags["torch_ddp_example"].test()
    assert states(run) == {"prepare_data": "success", "train": "success", "report": "success"}
    metrics = xcom(run, "train")
    assert metrics["ranks"] == 2 and metrics["epochs"] == 8 and metrics["accuracy"] > 0.9, metrics
    assert len(metrics["hosts"]) == 2  # local_mode=False on local[2]: a barrier job of 2 tasks
    relayed = relayed_text(caplog)
    assert "epoch 1/8: loss=" in relayed and "epoch 8/8: loss=" in relayed, relayed
    assert f"rank 0 result: {metrics}" in capsys.readouterr().out
    progress = stored(run, "train")  # what the Training tab draws, and what a retry resumes from
    metrics_stored, checkpoint = progress[METRICS_KEY], progress[CHECKPOINT_KEY]
    assert [step for step, _ in metrics_stored["series"]["loss"]] == list(range(1, 9))
    assert checkpoint["epoch"] == 8 and checkpoint["path"].endswith("ddp-epoch-8.pt") and checkpoint["finished"]


def test_operator_pushes_rank_0s_value_and_relays_every_line(dags, caplog):
    run = dags["torch_operator"].test()  # num_processes="{{ params.n }}", driver_log_verbosity left at its default
    assert states(run) == {"all_reduce": "success"}
    assert xcom(run, "all_reduce") == {"average": 2.0, "size": 2}
    assert not xcom(run, "all_reduce", "_link_SparkUILink")  # local[2]: no page outlives the task, so no link
    relayed = relayed_text(caplog)
    for line in ("rank 0 of 2 holds 1.0", "rank 1 of 2 holds 3.0", "rank 0 sees the average 2.0"):
        assert line in relayed, relayed


def test_killed_task_fails_and_leaves_no_process(dags, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = killed_once_training(dags["torch_on_kill"], str(pid_dir))
    assert states(run) == {"train_forever": "failed"}
    assert_all_gone(wait_for_pids(str(pid_dir), 2, timeout=1))


def test_a_stalled_task_fails_saying_where_its_processes_were(dags, caplog, capsys):
    run = dags["torch_stalled"].test()  # stall_timeout=10 s
    assert states(run) == {"train_until_stalled": "failed"}
    task_log = capsys.readouterr().out + caplog.text
    assert "RunStalledError" in task_log, task_log[-5000:]
    assert "reported progress for 10s (stall_timeout=10)" in task_log, task_log[-5000:]
    assert "was in wait_for_data (" in task_log and "torch_test_dags.py, line " in task_log, task_log[-5000:]


def test_a_failing_process_s_traceback_in_the_task_log_shows_the_dag_file_s_lines(dags, caplog, capsys):
    """The DAG file's functions travel by value; their frames name the file and show its lines (tests/
    test_user_tracebacks.py has the other places code comes from)."""
    run = dags["torch_fails_in_the_dag_file"].test()
    assert states(run) == {"train_on_too_little": "failed"}
    task_log = capsys.readouterr().out + caplog.text
    dag_file = os.path.join(os.environ["AIRFLOW__CORE__DAGS_FOLDER"], "torch_test_dags.py")
    lines = Path(dag_file).read_text().splitlines()
    for func, source in (
        ("train_on_too_little", "check_the_data(3)"),
        ("check_the_data", 'raise ValueError(f"only {rows} rows: not enough to train on")'),
    ):
        line = next(n for n, text in enumerate(lines, 1) if text.strip() == source)
        frame = f'File "{dag_file}", line {line}, in {func}\n    {source}\n'
        assert frame in task_log, task_log[-5000:]


def test_the_decorator_relays_every_line_by_default(dags):
    """@task.torch_distributed takes the operator's defaults: every printed line reaches the task log."""
    assert dags["torch_on_kill"].get_task("train_forever").driver_log_verbosity == "all"


def test_bad_num_processes_is_refused_when_the_dag_is_parsed():
    from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

    with pytest.raises(ValueError, match="num_processes must be a positive int, not 0"):
        TorchDistributorOperator(task_id="t", python_callable=print, num_processes=0)
    with pytest.raises(ValueError, match="exit_timeout must be a positive number of seconds"):
        TorchDistributorOperator(task_id="t", python_callable=print, num_processes=2, exit_timeout=-5)


def test_a_dag_file_run_as_a_script_ships_the_training_function_beside_it():
    """`python torch_test_dags.py`, whose `__main__` block calls dag.test(), with the task's callable from
    helpers_beside.py beside it. Airflow imports multiprocessing, which makes `__mp_main__` an alias of `__main__`.
    Before: the task failed with ValueError: <module '__main__' from '.../torch_test_dags.py'> is not registered
    for pickle by value (the DAG file was listed twice beside the helper module, and unregistered twice)."""
    from airflow.models.dagrun import DagRun

    dag_file = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"], "torch_test_dags.py")
    proc = subprocess.run([sys.executable, str(dag_file)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = DagRun.find(dag_id="torch_helper_beside")
    assert states(run) == {"train": "success"}, (proc.stdout + proc.stderr)[-5000:]
    assert xcom(run, "train") == 2
