"""A real Airflow deployment (`airflow standalone`: scheduler with LocalExecutor, API server, dag processor,
triggerer) against the loopback standalone Spark cluster, driven and checked through the REST API as a user would;
and, where namespace hosts can be made (tests/hosts.py), its tasks' ranks on Spark workers on 2 hosts.

The cluster has room for one 2-rank job at a time: runs triggered together wait their turn for task slots.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from airflow_deployment import AirflowDeployment, event_lines, log_text, show_log_if_failed
from hosts import Hosts, cannot_make_hosts
from jobs import alive, wait_for_pids
from mlflow import MlflowClient
from spark_cluster import free_port

EXAMPLE = "horovod_operator_example"  # dags/: HorovodRunnerOperator, driver_log_verbosity="all"
CONNECT = "hvd_on_spark_connect"  # dags/hvd_connect_dags.py: HorovodRunnerOperator on a spark_connect connection
DURABLE, DEFERRED = "durable_training", "deferred_training"  # dags/hvd_durable_dags.py: runs outliving the task
MISSED_HEARTBEATS, LATE_RESUME = "durable_missed_heartbeats", "deferred_late_resume"  # (hvd_durable_dags.py too)
HOLD_POOL, DEFERRAL_TIMEOUT = "hold_the_pool_slot", "deferred_execution_timeout"
CLIENT_ADDRESS = "hvd_client_address_over_connect"  # dags/hvd_connect_dags.py: spark.horovodRunner.driverHost set
DATAFRAME = "torch_dataframe_example"  # dags/: dataframe= (a templated SQL string), here on the standalone cluster
DAGS = [
    *(EXAMPLE, "hvd_retry", "hvd_unreachable_master", "hvd_on_kill", "hvd_on_hosts", "torch_resume_on_retry", CONNECT),
    "hvd_mlflow_killed_hard",
    *(DURABLE, DEFERRED, MISSED_HEARTBEATS, LATE_RESUME, HOLD_POOL, DEFERRAL_TIMEOUT, CLIENT_ADDRESS),
    DATAFRAME,
]
# the Connect server (conftest's connect_durable) on local[9]: three submitted runs side by side (2 ranks and a host
# each), for the tests of Airflow's own ends of a try (test_airflow_ending_a_try_...)
CONNECT_SLOTS = 9
# a task that misses its heartbeats this long is failed by the scheduler (Airflow's default: 300 s); a live
# supervisor heartbeats every 5 s ([workers] min_heartbeat_interval)
HEARTBEAT_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """2 hosts of 1 core each, or None where they cannot be made (not root, no `ip netns`)."""
    if cannot_make_hosts() is not None:
        yield None
        return
    hosts = Hosts(tmp_path_factory.mktemp("hosts"), cores=[1, 1]).start()
    yield hosts
    hosts.stop()


@pytest.fixture(scope="module")
def airflow(standalone_cluster, hosts, connect_durable, mlflow_server, postgres, tmp_path_factory, request):
    home = tmp_path_factory.mktemp("airflow-deployment")
    # a spark connection as the connection form invites: the scheme in Host, the port in its own field
    spark_default = {
        "conn_type": "spark",
        "host": "spark://127.0.0.1",
        "port": standalone_cluster.port,
        "extra": {"spark.executor.cores": "1", **standalone_cluster.app_conf},
    }
    unreachable = {"conn_type": "spark", "host": "spark://127.0.0.1", "port": free_port()}
    env = {
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(spark_default),
        "AIRFLOW_CONN_SPARK_UNREACHABLE": json.dumps(unreachable),
        # the URI form; a run that outlives its task holds a slot for its host beside its ranks'
        "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": connect_durable.url.replace("sc://", "spark-connect://"),
        "MLFLOW_TRACKING_URI": mlflow_server,  # for the tasks with mlflow=True
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
    }
    if hosts is not None:  # the driver, in the task's process, listens on the bridge the hosts reach
        on_hosts = {"spark.executor.cores": "1", **hosts.session_conf()}
        env["AIRFLOW_CONN_SPARK_HOSTS"] = json.dumps(
            {"conn_type": "spark", "host": f"spark://{hosts.driver_address}", "port": hosts.port, "extra": on_hosts}
        )
    failed_before = request.session.testsfailed
    database = postgres.create_database("airflow_deployment")
    deployment = AirflowDeployment(home, os.environ["AIRFLOW__CORE__DAGS_FOLDER"], database, env).start(DAGS)
    # dags/hvd_durable_dags.py's pool of one slot: its deferred task's resume waits while another task holds it
    deployment._json("POST", "/pools", json={"name": "late_resume", "slots": 1, "include_deferred": False})
    yield deployment
    deployment.stop()
    show_log_if_failed(request, deployment, failed_before)


@pytest.fixture(scope="module")
def runs(airflow):
    """Three DAG runs triggered together on a cluster with room for one; each waits its turn."""
    started = {dag_id: airflow.trigger(dag_id) for dag_id in (EXAMPLE, "hvd_retry", "hvd_unreachable_master")}
    return {dag_id: (run_id, airflow.wait_for_run(dag_id, run_id, timeout=240)) for dag_id, run_id in started.items()}


def test_training_run_succeeds_with_both_ranks_in_the_task_log(airflow, runs):
    run_id, state = runs[EXAMPLE]
    records = airflow.task_log(EXAMPLE, run_id, "allreduce")
    assert state == "success", log_text(records)
    events = event_lines(records)
    both_ranks = [
        "[rank 0] rank 0 of 2 holds 1.0",
        "[rank 1] rank 1 of 2 holds 3.0",
        "[rank 0] rank 0 sees the average 2.0",
        "[rank 1] rank 1 sees the average 2.0",
    ]
    assert not [line for line in both_ranks if line not in events], log_text(records)
    assert airflow.xcom(EXAMPLE, run_id, "allreduce") == {"average": 2.0, "size": 2}


def test_a_successful_run_logs_no_error_and_spark_speaks_at_its_own_level(airflow, runs):
    records = airflow.task_log(EXAMPLE, runs[EXAMPLE][0], "allreduce")
    errors = [r for r in records if r.get("level") in ("error", "critical")]
    assert not errors, log_text(errors)
    native = [r for r in records if "Unable to load native-hadoop library" in str(r.get("event"))]
    assert [(r["level"], r["logger"]) for r in native] == [("warning", "spark.NativeCodeLoader")], log_text(records)
    assert not [r for r in records if "[Stage " in str(r.get("event"))], "a console progress bar in the task log"


def test_spark_ui_link_answers_after_the_task(airflow, runs, standalone_cluster):
    run_id, _ = runs[EXAMPLE]
    link = airflow.extra_links(EXAMPLE, run_id, "allreduce")["Spark UI"]
    assert link.startswith(f"{standalone_cluster.web_ui}/app/?appId=app-"), link
    with urllib.request.urlopen(link, timeout=10) as page:  # the task's SparkContext is long gone
        assert page.status == 200
        assert "horovod_operator_example.allreduce" in page.read().decode()


def test_a_task_whose_rank_fails_succeeds_on_its_retry(airflow, runs):
    run_id, state = runs["hvd_retry"]
    first, second = (airflow.task_log("hvd_retry", run_id, "flaky", n) for n in (1, 2))
    assert state == "success", log_text(first + second)
    assert airflow.task_instance("hvd_retry", run_id, "flaky")["try_number"] == 2
    assert "rank 1 fails on the first try" in log_text(first)
    assert airflow.xcom("hvd_retry", run_id, "flaky") == {"attempt": 2, "size": 2}


def test_an_unreachable_master_fails_with_one_sentence(airflow, runs):
    run_id, state = runs["hvd_unreachable_master"]
    records = airflow.task_log("hvd_unreachable_master", run_id, "never_starts")
    assert state == "failed"
    text = log_text(records)
    assert "Nothing listens at the Spark master spark://127.0.0.1:" in text and "'spark_unreachable'" in text, text
    assert "\tat " not in text and "Py4J" not in text, text  # no JVM stack trace


def test_a_task_on_a_spark_connect_connection_runs_its_ranks_over_the_server(airflow, connect_durable):
    run_id = airflow.trigger(CONNECT)
    state = airflow.wait_for_run(CONNECT, run_id, timeout=240)
    records = airflow.task_log(CONNECT, run_id, "allreduce")
    assert state == "success", log_text(records)
    assert airflow.xcom(CONNECT, run_id, "allreduce") == {"size": 2, "sum": 3.0}
    events = event_lines(records)
    server = connect_durable.url.removeprefix("sc://")
    ran_over = f"Running over Spark Connect at {server}: application local-"
    assert any(line.startswith(ran_over) for line in events), log_text(records)
    # the server's UI is off: no link, and the log says why
    assert "has its UI off (spark.ui.enabled=false)" in log_text(records)
    assert not airflow.extra_links(CONNECT, run_id, "allreduce")["Spark UI"]
    assert "[rank 0] rank 0 of 2 sums 3.0" in events and "[rank 1] rank 1 of 2 sums 3.0" in events, log_text(records)


def test_marking_a_running_training_task_failed_ends_its_ranks_and_spark_job(
    airflow, runs, standalone_cluster, tmp_path
):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run_id = airflow.trigger("hvd_on_kill", {"pid_dir": str(pid_dir)})
    try:
        pids = wait_for_pids(str(pid_dir), 2, timeout=120)
    except TimeoutError:
        pytest.fail(log_text(airflow.task_log("hvd_on_kill", run_id, "train_forever")))
    assert active_apps(standalone_cluster) == ["hvd_on_kill.train_forever"]
    airflow.mark_failed("hvd_on_kill", run_id, "train_forever")
    marked = time.monotonic()
    while time.monotonic() - marked < 10 and (any(alive(pid) for pid in pids) or active_apps(standalone_cluster)):
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "rank processes outlived the task marked failed"
    assert active_apps(standalone_cluster) == [], "the task's Spark application outlived it"
    assert airflow.wait_for_run("hvd_on_kill", run_id, timeout=60) == "failed"


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_try_killed_hard_leaves_its_mlflow_run_to_the_retry_which_ends_it_killed(airflow, mlflow_server, tmp_path):
    """SIGKILL to the task's process (a lost worker, the OOM killer): its MLflow run cannot be ended by it, so the
    retry, linked to it through the task state store, ends it KILLED; the "MLflow run" link is the retry's."""
    dag_id, task_id = "hvd_mlflow_killed_hard", "lose_the_first_try"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run_id = airflow.trigger(dag_id, {"pid_dir": str(pid_dir)})
    try:
        rank_pid = wait_for_pids(str(pid_dir), 2, timeout=120)[0]
    except TimeoutError:
        pytest.fail(log_text(airflow.task_log(dag_id, run_id, task_id)))
    task_pid = parent_pid(parent_pid(rank_pid))  # rank ← its reaper ← the driver, in the task's process
    assert "airflow" in Path(f"/proc/{task_pid}/cmdline").read_text(), "not the task's process"
    os.kill(task_pid, signal.SIGKILL)
    state = airflow.wait_for_run(dag_id, run_id, timeout=240)
    second_log = log_text(airflow.task_log(dag_id, run_id, task_id, 2))
    assert state == "success", second_log
    mlflow = MlflowClient(mlflow_server)
    first, second = sorted(
        mlflow.search_runs(["0"], f"tags.`airflow.run_id` = '{run_id}'"),
        key=lambda run: int(run.data.tags["airflow.try_number"]),
    )
    assert (first.info.status, second.info.status) == ("KILLED", "FINISHED")
    assert second.data.tags["hvd.previous_run_id"] == first.info.run_id
    assert second.info.run_id in first.data.tags["hvd.ended_by"]
    link = airflow.extra_links(dag_id, run_id, task_id)["MLflow run"]
    assert link == f"{mlflow_server}/#/experiments/0/runs/{second.info.run_id}" and link in second_log


def test_a_torch_distributed_task_names_its_failed_rank_and_resumes_on_its_retry(airflow, standalone_cluster, tmp_path):
    dag_id, task_id = "torch_resume_on_retry", "train_resumable"
    run_id = airflow.trigger(dag_id, {"ckpt_dir": str(tmp_path)})
    state = airflow.wait_for_run(dag_id, run_id, timeout=300)
    first, second = (airflow.task_log(dag_id, run_id, task_id, n) for n in (1, 2))
    assert state == "success", log_text(first + second)
    first_text = log_text(first)
    assert "rank 1 of 2 failed" in first_text and "rank 1 lost its shard on the first try" in first_text, first_text
    # the retry resumed from the checkpoint the first try reported after epoch 2, and pushed rank 0's value
    assert airflow.xcom(dag_id, run_id, task_id) == {"resumed_from": 2, "size": 2}
    link = airflow.extra_links(dag_id, run_id, task_id)["Spark UI"]
    assert link.startswith(f"{standalone_cluster.web_ui}/app/?appId=app-"), link


def test_a_task_trains_on_the_rows_of_its_dataframe_on_the_standalone_cluster(airflow, standalone_cluster):
    run_id = airflow.trigger(DATAFRAME, {"rows": 4096})
    state = airflow.wait_for_run(DATAFRAME, run_id, timeout=300)
    records = airflow.task_log(DATAFRAME, run_id, "train")
    assert state == "success", log_text(records)
    metrics = airflow.xcom(DATAFRAME, run_id, "train")
    assert metrics["rows"] == 4096 and metrics["shard_rows"] == 2048 and metrics["ranks"] == 2, metrics
    assert metrics["accuracy"] > 0.8, metrics
    assert any("trained 5 epochs on 4096 rows: accuracy=" in line for line in event_lines(records)), log_text(records)
    link = airflow.extra_links(DATAFRAME, run_id, "train")["Spark UI"]
    assert link.startswith(f"{standalone_cluster.web_ui}/app/?appId=app-"), link  # the cluster's, not local


def test_a_task_runs_its_ranks_on_the_spark_workers_of_two_hosts(airflow, hosts):
    if hosts is None:
        pytest.skip(f"namespace hosts: {cannot_make_hosts()}")
    run_id = airflow.trigger("hvd_on_hosts")
    state = airflow.wait_for_run("hvd_on_hosts", run_id, timeout=300)
    records = airflow.task_log("hvd_on_hosts", run_id, "where_ranks_run")
    assert state == "success", log_text(records)
    result = airflow.xcom("hvd_on_hosts", run_id, "where_ranks_run")
    assert sorted(result["hosts"]) == ["host-0", "host-1"] and result["sum"] == 3.0, result  # one rank on each
    events = event_lines(records)
    for rank, host in enumerate(result["hosts"]):
        assert f"[rank {rank}] rank {rank} runs on {host}" in events, log_text(records)


def active_apps(cluster) -> list[str]:
    with urllib.request.urlopen(f"{cluster.web_ui}/json/", timeout=5) as resp:
        return [app["name"] for app in json.load(resp)["activeapps"]]


# --- runs that outlive the task (dags/hvd_durable_dags.py; docs/durable-runs.md) ---


class Training:
    """Triggers DAGs of dags/hvd_durable_dags.py; their ranks' pid files and the gate that ends their training."""

    def __init__(self, airflow: AirflowDeployment, pid_dir: Path, gate: Path) -> None:
        self.airflow, self.pid_dir, self.gate = airflow, pid_dir, gate
        self.started: list[tuple[str, str]] = []

    def __call__(self, dag_id: str) -> tuple[str, list[int]]:
        """Trigger ``dag_id``: its run's id and its two ranks' pids, once both have started."""
        run_id = self.airflow.trigger(dag_id, {"pid_dir": str(self.pid_dir), "gate": str(self.gate)})
        self.started.append((dag_id, run_id))
        try:
            return run_id, wait_for_pids(str(self.pid_dir), 2, timeout=180)
        except TimeoutError:
            pytest.fail(log_text(self.airflow.task_log(dag_id, run_id, "train")))


@pytest.fixture
def training(airflow, tmp_path):
    (tmp_path / "pids").mkdir()
    trigger = Training(airflow, tmp_path / "pids", tmp_path / "gate")
    yield trigger
    trigger.gate.touch()  # a run a failure left ends too, before the next test's needs the server's task slots
    for dag_id, run_id in trigger.started:
        airflow.wait_for_run(dag_id, run_id, timeout=120)


def starts_per_rank(pid_dir: Path) -> dict[str, list[str]]:
    return {path.name: path.read_text().split() for path in sorted(pid_dir.glob("rank-*.pids"))}


def wait_for_log(airflow, dag_id: str, run_id: str, text: str, try_number: int, timeout: float = 180.0) -> str:
    """The task log's text of ``try_number`` once it holds ``text``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            logged = log_text(airflow.task_log(dag_id, run_id, "train", try_number))
        except AssertionError:  # the try has not started yet
            logged = ""
        if text in logged:
            return logged
        assert time.monotonic() < deadline, f"no {text!r} in try {try_number}'s log:\n{logged[-3000:]}"
        time.sleep(0.5)


def ranks_end_within(pids: list[int], seconds: float) -> list[int]:
    """The ranks still alive after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_durable_tasks_retry_attaches_to_the_run_its_lost_try_left_training(airflow, training, mlflow_server, how):
    """SIGKILL of the task's process (a lost worker, the OOM killer), or SIGTERM with the task still running (a
    worker's graceful shutdown: the task detaches): the retry attaches to the same run, whose ranks never
    restarted, pushes rank 0's value, and goes on with its one MLflow run."""
    run_id, pids = training(DURABLE)
    first = wait_for_log(airflow, DURABLE, run_id, "[rank 1] rank 1 step 2", 1)
    submitted = re.search(r"Submitted the run: (\{.*?\}) \(a retry", first)
    assert submitted, first
    stored = airflow.state_store(DURABLE, run_id, "train")
    assert stored["hvd_job_id"] == submitted.group(1), stored
    task_pid = airflow.task_instance(DURABLE, run_id, "train")["pid"]
    assert task_pid and "airflow" in Path(f"/proc/{task_pid}/cmdline").read_text(), task_pid
    os.kill(task_pid, getattr(signal, how))
    second = wait_for_log(airflow, DURABLE, run_id, "Attached to the run an earlier try submitted", 2)
    if how == "SIGTERM":
        first = log_text(airflow.task_log(DURABLE, run_id, "train", 1))
        assert "The worker is shutting down: detaching from the run, which goes on for the retry" in first, first
    assert all(alive(pid) for pid in pids), "a rank ended with the task's lost try"
    wait_for_log(airflow, DURABLE, run_id, "rank 0 step", 2)  # the ranks' later lines, in the retry's log
    training.gate.touch()
    assert airflow.wait_for_run(DURABLE, run_id, timeout=120) == "success", log_text(
        airflow.task_log(DURABLE, run_id, "train", 2)
    )
    second = log_text(airflow.task_log(DURABLE, run_id, "train", 2))
    assert "[rank 0] rank 0 passed the gate at step" in second, second
    assert starts_per_rank(training.pid_dir) == {f"rank-{r}.pids": [str(pids[r])] for r in (0, 1)}  # one start each
    value = airflow.xcom(DURABLE, run_id, "train")
    assert value["pid"] == pids[0] and value["total"] >= 2 * 2, value
    # the Training tab's curve: every step of the one run, from before the loss and after, written by the retry
    stored = airflow.state_store(DURABLE, run_id, "train")
    metrics = stored["hvd_metrics"]
    assert metrics["try_number"] == 2
    assert [step for step, _ in metrics["series"]["loss"]] == list(range(value["steps"])), metrics
    # one MLflow run for both tries, made by the run's host: the retry went on with it, and it has every step
    run = one_mlflow_run(mlflow_server, run_id)
    assert run.info.status == "FINISHED", run.info
    assert stored["hvd_mlflow"] == {"run_id": run.info.run_id, "url": mlflow_url(mlflow_server, run), "try_number": 2}
    assert f"Try 2 goes on with MLflow run {run.info.run_id}" in second, second
    history = MlflowClient(mlflow_server).get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(value["steps"]))


def test_marking_a_durable_task_failed_ends_every_rank_within_10s(airflow, training, mlflow_server):
    run_id, pids = training(DURABLE)
    wait_for_log(airflow, DURABLE, run_id, "[rank 1] rank 1 step 1", 1)
    airflow.mark_failed(DURABLE, run_id, "train")
    assert not ranks_end_within(pids, 10), "ranks outlived the task marked failed"
    assert airflow.wait_for_run(DURABLE, run_id, timeout=60) == "failed"
    deadline = time.monotonic() + 30  # (the host ends it as the run ends, FINAL_WRITE_S at most)
    while (run := one_mlflow_run(mlflow_server, run_id)).info.status == "RUNNING":
        assert time.monotonic() < deadline, "the cancelled run's MLflow run is still RUNNING"
        time.sleep(0.5)
    assert run.info.status == "KILLED", run.info


def one_mlflow_run(tracking_uri: str, run_id: str):
    """The one MLflow run of the DAG run ``run_id`` (default experiment)."""
    runs = MlflowClient(tracking_uri).search_runs(["0"], f"tags.`airflow.run_id` = '{run_id}'")
    assert len(runs) == 1, [(r.info.run_id, r.data.tags.get("airflow.try_number")) for r in runs]
    return runs[0]


def mlflow_url(tracking_uri: str, run) -> str:
    return f"{tracking_uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"


def test_a_deferrable_task_is_deferred_while_it_trains_and_marking_it_failed_ends_every_rank(airflow, training):
    run_id, pids = training(DEFERRED)
    deadline = time.monotonic() + 60
    while (state := airflow.task_instance(DEFERRED, run_id, "train")["state"]) != "deferred":
        assert time.monotonic() < deadline, f"the task is {state}, not deferred, while its run trains"
        time.sleep(0.5)
    logged = wait_for_log(airflow, DEFERRED, run_id, "[rank 1] rank 1 step 3", 1)  # relayed by the trigger
    assert "Submitted the run: {" in logged, logged
    airflow.mark_failed(DEFERRED, run_id, "train")
    assert not ranks_end_within(pids, 10), "ranks outlived the deferred task marked failed"


def test_a_deferrable_task_resumes_on_a_worker_with_rank_0s_value_its_run_restarted_in_its_one_try(
    airflow, training, mlflow_server
):
    """The task defers while its run trains; rank 1, killed (SIGKILL), restarts from the last checkpoint in the
    run's host (max_restarts=1): the restart is in the task log, the trigger's XComs and then the task state store,
    on the Training tab's curve, and in the one MLflow run; the task succeeds in its one try with rank 0's value.
    Before: submit() refused max_restarts, and nothing in Airflow recorded a restart."""
    run_id, _ = training(DEFERRED)
    first = {rank: int((training.pid_dir / f"rank-{rank}.pid").read_text()) for rank in (0, 1)}
    wait_for_log(airflow, DEFERRED, run_id, "[rank 0] rank 0 step 1", 1)
    assert airflow.task_instance(DEFERRED, run_id, "train")["state"] == "deferred"
    # the trigger's progress, as the task's XComs (a trigger has no task state store): the Training tab's while
    # the task is deferred
    deadline = time.monotonic() + 60
    while not (metrics := deferred_xcom(airflow, run_id)) or not deferred_xcom(airflow, run_id, "hvd_checkpoint"):
        assert time.monotonic() < deadline, "no hvd_metrics and hvd_checkpoint XComs from the trigger"
        time.sleep(0.5)
    assert metrics["try_number"] == 1 and metrics["series"]["loss"][0][0] == 0, metrics
    tab_url = f"{airflow.url}/hvd-training/dags/{DEFERRED}/runs/{quote(run_id, safe='')}/tasks/train"
    tab = airflow.api.get(tab_url)
    assert tab.status_code == 200, tab.text
    assert 'data-state="deferred"' in tab.text and "metrics of rank 0 from try 1" in tab.text, tab.text
    assert 'class="curve"' in tab.text, tab.text  # the Training tab draws it while the task is deferred
    training_run = one_mlflow_run(mlflow_server, run_id)  # (the run's host made it: RUNNING)
    assert f'MLflow run of try 1: <a href="{mlflow_url(mlflow_server, training_run)}"' in tab.text, tab.text
    # the trigger's record of it (the task's own comes only once it resumes)
    recorded = airflow.api.get(f"{airflow._ti_path(DEFERRED, run_id, 'train')}/xcomEntries/hvd_mlflow")
    assert recorded.status_code == 200, recorded.text
    assert recorded.json()["value"]["run_id"] == training_run.info.run_id, recorded.text
    # a rank killed after a checkpoint: the run's host starts attempt 2 from it, still in the deferred try
    os.kill(first[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (restarts := deferred_xcom(airflow, run_id, "hvd_restarts")) or (
        restarts["attempts"][-1]["first_step"] is None  # (attempt 2 has reported a step)
    ):
        assert time.monotonic() < deadline, log_text(airflow.task_log(DEFERRED, run_id, "train", 1))[-5000:]
        time.sleep(0.5)
    assert airflow.task_instance(DEFERRED, run_id, "train")["state"] == "deferred"
    tab = airflow.api.get(tab_url).text
    assert '<g class="restart" data-attempt="2">' in tab and 'id="restarts"' in tab, tab  # on the curve
    training.gate.touch()
    state = airflow.wait_for_run(DEFERRED, run_id, timeout=120)
    logged = log_text(airflow.task_log(DEFERRED, run_id, "train", 1))
    assert state == "success", logged
    assert airflow.task_instance(DEFERRED, run_id, "train")["try_number"] == 1
    value = airflow.xcom(DEFERRED, run_id, "train")
    point = value["resumed_from"]
    resumed = f"{training.pid_dir}/step-{point['step']}.json (step={point['step']})"
    restart = (
        "TorchDistributor: restart 1 of 1 after torch.distributed rank 1 of 2 failed: was killed by SIGKILL "
        f"without a Python exception: resuming from {resumed}"
    )
    assert restart in logged and "[rank 1, attempt 2] rank 1 passed the gate at step" in logged, logged[-5000:]
    second = {rank: int((training.pid_dir / f"rank-{rank}.pid").read_text()) for rank in (0, 1)}
    assert value["pid"] == second[0]
    assert starts_per_rank(training.pid_dir) == {f"rank-{r}.pids": [str(first[r]), str(second[r])] for r in (0, 1)}
    # resumed, the task wrote the run's last progress to the task state store: every step (each once), its
    # restart, and its MLflow run
    stored = airflow.state_store(DEFERRED, run_id, "train")
    steps = [step for step, _ in stored["hvd_metrics"]["series"]["loss"]]
    assert steps[0] == 0 and steps[-1] == value["steps"] - 1 and steps == sorted(set(steps)), steps
    kept = stored["hvd_restarts"]
    assert (kept["try_number"], kept["restarts"], kept["left_out"]) == (1, 1, 0), kept
    one, two = kept["attempts"]
    assert (one["attempt"], one["size"], one["cause_kind"], one["first_step"]) == (1, 2, "signal", 0), one
    assert one["resumed_from"] is None and "was killed by SIGKILL" in one["cause"] and one["ended_at"], one
    assert (two["attempt"], two["cause"], two["first_step"]) == (2, None, point["step"] + 1), two
    assert two["resumed_from"]["path"] == point["path"] and two["ended_at"], two
    run = one_mlflow_run(mlflow_server, run_id)
    assert run.info.status == "FINISHED", run.info
    assert stored["hvd_mlflow"] == {"run_id": run.info.run_id, "url": mlflow_url(mlflow_server, run), "try_number": 1}
    client = MlflowClient(mlflow_server)  # one MLflow run holds both attempts: the restart as a metric and tags
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "hvd.restarts")] == [(1, 1.0)]
    assert json.loads(run.data.tags["hvd.attempt.1"])["cause_kind"] == "signal"
    assert json.loads(run.data.tags["hvd.attempt.2"])["resumed_from"] == resumed


def deferred_xcom(airflow, run_id: str, key: str = "hvd_metrics") -> dict | None:
    resp = airflow.api.get(f"{airflow._ti_path(DEFERRED, run_id, 'train')}/xcomEntries/{key}")
    return resp.json()["value"] if resp.status_code == 200 else None


# --- Airflow's own ends of a try, side by side: missed heartbeats, a late resume, a deferral's timeout ---


def ti_state(airflow, dag_id: str, run_id: str, task_id: str = "train") -> str | None:
    return airflow.task_instance(dag_id, run_id, task_id)["state"]


def wait_for_state(airflow, dag_id: str, run_id: str, wanted, timeout: float, task_id: str = "train") -> str | None:
    """The task instance's state once ``wanted(state)`` holds."""
    deadline = time.monotonic() + timeout
    while not wanted(state := ti_state(airflow, dag_id, run_id, task_id)):
        assert time.monotonic() < deadline, f"{dag_id} {run_id} {task_id} still {state} after {timeout:.0f}s"
        time.sleep(1)
    return state


class Scenario:
    """One DAG run of dags/hvd_durable_dags.py with its own pid files and gate; what it saw, for the test to read."""

    def __init__(self, airflow, dag_id: str, root: Path) -> None:
        self.airflow, self.dag_id = airflow, dag_id
        self.pid_dir, self.gate = root / "pids", root / "gate"
        self.pid_dir.mkdir(parents=True)
        self.run_id = ""
        self.seen: dict[str, object] = {}

    def start(self) -> list[int]:
        """Trigger the DAG; the pids of rank 0 and 1, once both started."""
        self.run_id = self.airflow.trigger(self.dag_id, {"pid_dir": str(self.pid_dir), "gate": str(self.gate)})
        wait_for_pids(str(self.pid_dir), 2, timeout=300)
        return [int((self.pid_dir / f"rank-{rank}.pid").read_text()) for rank in (0, 1)]

    def log(self, try_number: int) -> str:
        return log_text(self.airflow.task_log(self.dag_id, self.run_id, "train", try_number))

    def starts(self) -> dict[str, list[str]]:
        return starts_per_rank(self.pid_dir)


def missed_heartbeats(scenario: Scenario) -> None:
    """The first try's supervisor stops heartbeating (stopped) past the heartbeat timeout: the scheduler puts the
    task instance up_for_retry; let go, the supervisor hears 409 from the API server and SIGTERMs the task."""
    airflow, seen = scenario.airflow, scenario.seen
    seen["pids"] = pids = scenario.start()
    dag_id, run_id = scenario.dag_id, scenario.run_id
    wait_for_log(airflow, dag_id, run_id, "Submitted the run: {", 1)
    task_pid = airflow.task_instance(dag_id, run_id, "train")["pid"]
    supervisor = parent_pid(task_pid)  # (LocalExecutor's worker process supervises the task's)
    assert "airflow" in Path(f"/proc/{supervisor}/cmdline").read_text(), supervisor
    os.kill(supervisor, signal.SIGSTOP)
    try:
        seen["state"] = wait_for_state(airflow, dag_id, run_id, lambda s: s != "running", HEARTBEAT_TIMEOUT_S + 120)
    finally:
        os.kill(supervisor, signal.SIGCONT)
    wait_for_log(airflow, dag_id, run_id, "detaching from the run", 1)
    seen["alive after the first try"] = [pid for pid in pids if alive(pid)]
    wait_for_log(airflow, dag_id, run_id, "Attached to the run an earlier try submitted", 2, timeout=240)
    wait_for_log(airflow, dag_id, run_id, "rank 0 step", 2)  # the ranks' later lines, in the retry's log
    scenario.gate.touch()
    seen["end"] = airflow.wait_for_run(dag_id, run_id, timeout=240)


def late_resume(scenario: Scenario) -> None:
    """The deferred task's run ends while another task holds the pool's one slot past the run's detached_timeout
    (20 s): the task resumes late, as a task waiting for a busy pool does."""
    airflow, seen = scenario.airflow, scenario.seen
    seen["pids"] = scenario.start()
    dag_id, run_id = scenario.dag_id, scenario.run_id
    wait_for_state(airflow, dag_id, run_id, lambda s: s == "deferred", 120)
    held = scenario.gate.with_name("held")
    holder = airflow.trigger(HOLD_POOL, {"gate": str(held)})
    try:
        wait_for_state(airflow, HOLD_POOL, holder, lambda s: s == "running", 120, task_id="hold")
        scenario.gate.touch()  # the run ends; the trigger fires and detaches
        wait_for_state(airflow, dag_id, run_id, lambda s: s != "deferred", 120)
        # nothing to wait on but the time: past the run's detached_timeout with nobody attached to it
        time.sleep(20 + 15)
        seen["state while late"] = ti_state(airflow, dag_id, run_id)
    finally:
        held.touch()
    seen["end"] = airflow.wait_for_run(dag_id, run_id, timeout=240)
    airflow.wait_for_run(HOLD_POOL, holder, timeout=60)


def deferral_timeout(scenario: Scenario) -> None:
    """A deferred task's execution_timeout (90 s) passes while its run trains on: the deferral times out."""
    airflow, seen = scenario.airflow, scenario.seen
    seen["pids"] = pids = scenario.start()
    dag_id, run_id = scenario.dag_id, scenario.run_id
    wait_for_state(airflow, dag_id, run_id, lambda s: s == "deferred", 120)
    wait_for_state(airflow, dag_id, run_id, lambda s: s != "deferred", 90 + 120)
    seen["alive 30s after the timeout"] = ranks_end_within(pids, 30)
    seen["end"] = airflow.wait_for_run(dag_id, run_id, timeout=240)


@pytest.fixture(scope="module")
def airflow_ends(airflow, tmp_path_factory):
    """The three scenarios, side by side (each a thread): what each saw, or how it failed."""
    from concurrent.futures import ThreadPoolExecutor

    scenarios = {
        name: Scenario(airflow, dag_id, tmp_path_factory.mktemp(name))
        for name, dag_id in (
            ("missed_heartbeats", MISSED_HEARTBEATS),
            ("late_resume", LATE_RESUME),
            ("deferral_timeout", DEFERRAL_TIMEOUT),
        )
    }
    with ThreadPoolExecutor(len(scenarios)) as pool:
        done = {name: pool.submit(globals()[name], scenario) for name, scenario in scenarios.items()}
    try:
        yield {name: (scenarios[name], future.exception()) for name, future in done.items()}
    finally:
        for scenario in scenarios.values():
            scenario.gate.touch()  # a run a failure left ends too


def scenario_of(airflow_ends, name: str) -> Scenario:
    scenario, failed = airflow_ends[name]
    if failed is not None:
        logs = "\n".join(scenario.log(n) for n in (1, 2) if scenario.run_id)
        raise AssertionError(f"{name}: {failed!r}\n{logs[-6000:]}") from failed
    return scenario


@pytest.mark.timeout(900)  # (the first of them runs the three scenarios, side by side: 3-5 min)
def test_a_missed_heartbeat_leaves_the_run_to_the_retry_which_attaches(airflow_ends):
    """Airflow's scheduler fails a try that missed its heartbeats (up_for_retry), and its supervisor SIGTERMs
    the task: no user ended it, so the task detaches; the run trains on and the retry attaches to it."""
    scenario = scenario_of(airflow_ends, "missed_heartbeats")
    seen, pids = scenario.seen, scenario.seen["pids"]
    first, second = scenario.log(1), scenario.log(2)
    assert seen["state"] == "up_for_retry", seen
    assert (
        "Airflow ended this try: the task instance is up_for_retry, as after missed heartbeats: detaching from the "
        "run, which goes on for the retry" in first
    ), first
    assert "ending the run" not in first, first
    assert seen["alive after the first try"] == pids, "a rank ended with the try that missed its heartbeats"
    assert seen["end"] == "success", second
    assert "[rank 0] rank 0 passed the gate at step" in second, second
    assert scenario.starts() == {f"rank-{r}.pids": [str(pids[r])] for r in (0, 1)}  # one run: one start each
    assert scenario.airflow.xcom(scenario.dag_id, scenario.run_id, "train")["pid"] == pids[0]


@pytest.mark.timeout(900)  # (the first of them runs the three scenarios, side by side: 3-5 min)
def test_a_deferred_task_that_resumes_after_the_detached_timeout_gets_rank_0s_value(airflow_ends):
    """The trigger fired and detached; the task's resume waited for its pool's slot past the run's
    detached_timeout: the run's host kept the outcome (outcome_timeout) and the task gets rank 0's value, from
    the one run. (Passes once the runner's host keeps a finished run's outcome for outcome_timeout.)"""
    scenario = scenario_of(airflow_ends, "late_resume")
    seen, pids = scenario.seen, scenario.seen["pids"]
    logged = scenario.log(1)
    assert seen["state while late"] == "scheduled", seen  # resumed late: the pool's slot was held
    assert seen["end"] == "success", logged
    assert scenario.airflow.task_instance(scenario.dag_id, scenario.run_id, "train")["try_number"] == 1
    value = scenario.airflow.xcom(scenario.dag_id, scenario.run_id, "train")
    assert value["pid"] == pids[0], value
    assert scenario.starts() == {f"rank-{r}.pids": [str(pids[r])] for r in (0, 1)}


@pytest.mark.timeout(900)  # (the first of them runs the three scenarios, side by side: 3-5 min)
def test_a_deferred_tasks_execution_timeout_ends_its_deferral_and_every_rank(airflow_ends):
    """execution_timeout bounds the deferral too (defer(timeout=) with what is left of it): Airflow ends the
    deferral without the trigger's on_kill(); its cleanup() past the deadline ends every rank."""
    scenario = scenario_of(airflow_ends, "deferral_timeout")
    seen = scenario.seen
    logged = scenario.log(1)
    assert seen["alive 30s after the timeout"] == [], logged
    assert seen["end"] == "failed", logged
    assert "TaskDeferralTimeout" in logged or "Trigger timeout" in logged, logged
    assert "The task's execution_timeout has passed while it was deferred: ending the run" in logged, logged


def test_a_client_that_sets_its_own_address_for_its_ranks_runs_durably(airflow):
    """spark.horovodRunner.driverHost is where the task's own ranks would reach it (a client in a container):
    the run's host, in the cluster, listens where it is. (Passes once the host's plan leaves out the settings
    of the client's own address.)"""
    run_id = airflow.trigger(CLIENT_ADDRESS)
    state = airflow.wait_for_run(CLIENT_ADDRESS, run_id, timeout=240)
    logged = log_text(airflow.task_log(CLIENT_ADDRESS, run_id, "allreduce"))
    assert state == "success", logged
    assert "Submitted the run: {" in logged, logged
    assert airflow.xcom(CLIENT_ADDRESS, run_id, "allreduce") == {"size": 2, "sum": 3.0}
