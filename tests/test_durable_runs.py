"""Runs that outlive the submitting process (``submit()``, ``attach()``) on a real Spark Connect server on
local[3] (2 ranks and the run's host), whose application encrypts its traffic: the link and the channel are TLS.
The submitting, attaching and cancelling clients are real processes (tests/durable_client.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from connect_server import connect_session
from dataframe_jobs import ask_for_a_shard, horovod_ids
from jobs import (
    alive,
    allreduce_sum,
    assert_all_gone,
    big_value,
    fail_on_rank,
    hold_slots_until,
    train_until_gate,
    value_of,
    wait_for_pids,
)
from restart_jobs import train_until_killed

from airflow_provider_hvd import (
    HorovodRunner,
    HostSlotError,
    JobNotFoundError,
    JobStatus,
    LaunchError,
    RankFailedError,
    RunCancelledError,
    TorchDistributor,
    attach,
)
from airflow_provider_hvd.runner.durable import submit as submit_module
from airflow_provider_hvd.runner.durable.host import connection_string, later_attempt, open_session
from airflow_provider_hvd.runner.durable.link import LINK_CONF, LinkAddress
from airflow_provider_hvd.runner.shared.liveness import Liveness

TESTS = Path(__file__).resolve().parent
CLIENT = TESTS / "durable_client.py"
LIVENESS = Liveness(0.5, 3.0)  # a later attempt of the host's task called here probes the first one this often


class Client:
    """A client process, its output read line by line as it comes."""

    def __init__(self, *args: object) -> None:
        path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(CLIENT), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._drained = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 180.0) -> str:
        """The first line (from now on) that holds ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                self._drained = True
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} from {self.proc.args}; its output:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        """End the process (if it runs) and keep every line it wrote, also those not waited for yet."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        while not self._drained:  # what the reader has read by now, and what it reads within a moment
            try:
                line = self._queue.get(timeout=2)
            except queue.Empty:
                return
            self._drained = line is None
            if line is not None:
                self.lines.append(line)


@pytest.fixture
def gate(tmp_path):
    """The file that ends ``jobs.train_until_gate``; made at the end, so that a run a failure left ends too."""
    path = tmp_path / "gate"
    yield path
    path.touch()


def rank_steps(lines: list[str]) -> list[str]:
    """The training lines relayed, in the order they were: ``rank 0 step 3``."""
    return [line.split("] ", 1)[1] for line in lines if re.search(r"\[rank \d\] rank \d step \d+$", line)]


def repeated_tail(before: list[str], after: list[str]) -> int:
    """How many of the lines ``after`` begins with are the last ones of ``before`` (relayed again)."""
    return max(k for k in range(len(after) + 1) if k <= len(before) and before[len(before) - k :] == after[:k])


def assert_no_line_lost(before: list[str], after: list[str], repeated_at_most: int | None = None) -> None:
    """The training lines one client relayed (``before``), then the next one: each rank's steps in order, none
    lost, none repeated but a tail of ``before`` that ``after`` begins with."""
    again = repeated_tail(before, after)
    assert (repeated_at_most is None or again <= repeated_at_most) and not set(before) & set(after[again:]), (
        before,
        after,
    )
    for rank, steps in steps_per_rank(before + after[again:]).items():
        assert steps == list(range(len(steps))), f"rank {rank}'s lines lost or out of order: {steps}"


def steps_per_rank(lines: list[str]) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for line in lines:
        _, rank, _, step = line.split()
        steps.setdefault(int(rank), []).append(int(step))
    return steps


def test_a_run_outlives_its_killed_submitter_and_a_new_process_attaches(connect_durable, tmp_path, gate):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    submitter = Client("submit", connect_durable.url, pid_dir, gate)
    attacher = None
    try:
        job_id = submitter.wait_for("JOB_ID ").split("JOB_ID ", 1)[1]
        assert "token" not in job_id and json.loads(job_id)["session_id"]
        pids = wait_for_pids(str(pid_dir), 2, timeout=180)
        submitter.wait_for("[rank 1] rank 1 step 2")  # training, its lines relayed to the submitter
        os.kill(submitter.proc.pid, signal.SIGKILL)
        submitter.stop()
        before = rank_steps(submitter.lines)

        attacher = Client("attach", job_id)
        attacher.wait_for("[rank 0] rank 0 step")  # the run trains on: later lines reach the new process
        assert all(alive(pid) for pid in pids), "a rank did not outlive the submitting process"
        gate.touch()
        value = json.loads(attacher.wait_for("VALUE ").split("VALUE ", 1)[1])
        assert value["rank"] == 0 and value["pid"] in pids
        assert any("rank 1 passed the gate" in line for line in attacher.lines)
        # no line lost; none repeated but the last ones the killed process relayed and could not acknowledge
        assert_no_line_lost(before, rank_steps(attacher.lines), repeated_at_most=6)
        for rank in (0, 1):  # the same rank processes from start to end: no second start
            assert (pid_dir / f"rank-{rank}.pids").read_text().split() == [(pid_dir / f"rank-{rank}.pid").read_text()]
        assert_all_gone(pids, within=30)
        # nothing of the run is left on the server once its host, told that the value was fetched, released it
        assert "has ended: its Spark Connect session was closed" in str(wait_until_gone(job_id))
    finally:
        submitter.stop()
        if attacher is not None:
            attacher.stop()


def test_cancel_from_a_third_process_ends_every_rank_within_10s(connect_durable, tmp_path, gate):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2).submit(train_until_gate, pid_dir=str(pid_dir), gate=str(gate))
        pids = wait_for_pids(str(pid_dir), 2, timeout=180)
        assert job.status().phase in ("starting", "running") and not job.done()
        canceller = Client("cancel", job.id)
        try:
            canceller.wait_for("CANCELLING", timeout=120)  # (from when the cancel is sent)
            assert_all_gone(pids, within=10)
            canceller.wait_for("CANCELLED", timeout=30)
        finally:
            canceller.stop()
        with pytest.raises(RunCancelledError):
            job.wait(60)
        assert job.status().ended


def test_with_nobody_attached_the_lease_ends_the_run(connect_durable, tmp_path, gate):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2, detached_timeout=5).submit(train_until_gate, pid_dir=str(pid_dir), gate=str(gate))
        pids = wait_for_pids(str(pid_dir), 2, timeout=180)
        job.close()  # detached: nobody is
        assert_all_gone(pids, within=5 + 30)
    deadline = time.monotonic() + 30
    while True:  # the next attach says that it ended, and why: nothing of the run is left on the server
        try:
            attach(job.id).close()
        except JobNotFoundError as exc:
            assert "has ended: its Spark Connect session was closed" in str(exc)
            assert "detached_timeout of 5s" in str(exc)
            break
        assert time.monotonic() < deadline, "the run's session outlived its lease"


def test_a_rank_that_failed_while_nobody_was_attached_is_named_on_attach(connect_durable, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2, detached_timeout=300).submit(fail_on_rank, bad_rank=1, pid_dir=str(pid_dir))
        job_id = job.id
        job.close()
    pids = wait_for_pids(str(pid_dir), 2, timeout=180)
    assert_all_gone(pids, within=60)  # the run ended with nobody attached
    job = attach(job_id)
    with pytest.raises(RankFailedError) as caught:
        job.wait(60)
    assert caught.value.rank == 1
    assert str(caught.value).splitlines()[0] == "Horovod rank 1 of 2 failed: ValueError: boom from rank 1"
    assert "boom from rank 1" in (caught.value.remote_traceback or "")
    assert job.status().cause == "Horovod rank 1 of 2 failed: ValueError: boom from rank 1"


def test_a_submitted_run_restarts_in_its_host_and_another_process_gets_the_restarted_runs_value(
    connect_durable, tmp_path, caplog
):
    """max_restarts=1: rank 1 is SIGKILLed after epoch 3's checkpoint; the run's host starts attempt 2, which resumes
    from it. The submitter sees the restart in its log and job.status(); a process that attaches during attempt 2
    sees it in its status, relays attempt 2's lines tagged with it, and gets the restarted run's value.
    Before: submit() refused max_restarts."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    ckpt, pid_dir, gate = tmp_path / "ckpt", tmp_path / "pids", tmp_path / "gate"
    ckpt.mkdir()
    pid_dir.mkdir()
    attacher = None
    try:
        with connect_session(connect_durable.url):
            job = HorovodRunner(np=2, max_restarts=1, driver_log_verbosity="all").submit(
                train_until_killed, ckpt_dir=str(ckpt), pid_dir=str(pid_dir), kill_after_epoch=3, gate=str(gate)
            )
            until(lambda: job.status().attempt == 2 and job.status().ranks_started == 2, 180, "attempt 2 starts")
            assert job.status().phase in ("starting", "running") and not job.done()
            attacher = Client("attach", job.id)
            assert "attempt=2" in attacher.wait_for("ATTACHED ")  # (its job.status())
            gate.touch()
            value = json.loads(attacher.wait_for("VALUE ").split("VALUE ", 1)[1])
            assert value["resumed_from"]["path"] == f"{ckpt}/epoch-3.pt" and value["epochs_trained"] == [4, 5]
            assert job.wait(60) == value and job.status() == JobStatus("ended", 2, 2, None, attempt=2)
        assert [record["cause_kind"] for record in job.attempts] == ["signal", None]
        assert job.attempts[1]["resumed_from"]["epoch"] == 3 and job.checkpoint["path"] == f"{ckpt}/epoch-5.pt"
        restart = (
            "HorovodRunner: restart 1 of 1 after Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python "
            f"exception: resuming from {ckpt}/epoch-3.pt (epoch=3)"
        )
        assert restart in [r.getMessage() for r in caplog.records], caplog.text[-3000:]
        assert "[rank 1] epoch 3 done" in caplog.text and "[rank 1, attempt 2] epoch 4 done" in caplog.text
        assert any(line.endswith("[rank 1, attempt 2] epoch 4 done") for line in attacher.lines), attacher.lines
        assert_all_gone([int(path.read_text()) for path in pid_dir.glob("*.pid")], within=30)
    finally:
        gate.touch()
        if attacher is not None:
            attacher.stop()


def run_connection(url: str) -> str:
    """The connection string of a session of ``url`` (the runs' user): a run's session is opened with it."""
    with connect_session(url) as spark:
        return connection_string(spark)[0]


def test_a_host_that_spark_retried_refuses_to_start_the_run_again(connect_durable):
    """Spark retries a failed task (spark.task.maxFailures, on a cluster): the host's retry must not train from
    scratch under the same id. (local[3] retries no task: the retry is called as a retry calls it.)"""
    with connect_session(connect_durable.url) as spark:
        connection, shown, user_id = connection_string(spark)
    session_id = str(uuid.uuid4())
    open_session(connection, session_id).client.close()
    with pytest.raises(RuntimeError, match=r"the run's host was lost .* a submitted run is not started again"):
        later_attempt("HorovodRunner", connection, session_id, LIVENESS, start_wait=0)
    ident = {
        "server": shown,
        "session_id": session_id,
        "user_id": user_id,
        "tag": "horovod-runner-0",
        "runner": "HorovodRunner",
        "detached_timeout": 900.0,
    }
    with pytest.raises(JobNotFoundError, match=r"has ended: the run's host was lost .* not started again"):
        attach(ident)
    with pytest.raises(JobNotFoundError, match=r"has ended: its Spark Connect session was closed"):
        attach(ident)  # the attach released what was left of the run


def test_a_later_attempt_of_the_host_beside_a_live_first_one_leaves_the_run_alone(
    connect_durable, tmp_path, gate, caplog
):
    """A speculative copy of the host's task (Spark's speculation: a later attempt while the first one still runs)
    waits beside the live first attempt: it neither marks the run lost (an attach would end it) nor completes
    before it. Forced: speculation is not on in the test servers, so the copy is called as the task calls it."""
    with connect_session(connect_durable.url) as spark:
        connection = connection_string(spark)[0]
        job = HorovodRunner(np=2).submit(train_until_gate, pid_dir=str(tmp_path), gate=str(gate))
        wait_for_pids(str(tmp_path), 2, timeout=120)
        session_id = json.loads(job.id)["session_id"]
        copy: list[BaseException] = []
        copy_thread = threading.Thread(
            target=lambda: copy.extend(catch(lambda: later_attempt("HorovodRunner", connection, session_id, LIVENESS))),
            name="test-speculative-copy",
        )
        copy_thread.start()
        deadline = time.monotonic() + 30
        while "waits beside the first one" not in caplog.text:
            assert time.monotonic() < deadline and copy_thread.is_alive(), (copy, caplog.text)
            time.sleep(0.2)
        with attach(job.id, logs=False) as other:  # found alive: the copy marked nothing
            assert other.status().phase == "running"
            gate.touch()
            assert other.wait(120)["rank"] == 0
        assert job.wait(60)["rank"] == 0
    copy_thread.join(60)  # the first attempt gone (its session released), the copy gives up: it never completed
    assert len(copy) == 1 and isinstance(copy[0], RuntimeError), copy


def test_submit_and_wait_return_what_run_returns(connect_durable):
    with connect_session(connect_durable.url):
        with HorovodRunner(np=2).submit(allreduce_sum, base=1.0) as job, attach(job.id, logs=False) as other:
            assert job.wait(180) == {"rank": 0, "size": 2, "local_size": 2, "sum": 5.0}
            assert job.done() and job.status().ended
            assert other.wait(60) == job.wait()  # the first fetch does not end the host before the other has it


def test_a_submitted_run_on_a_dataframes_sql_gives_each_rank_its_rows_through_a_detach_and_attach(connect_durable):
    """submit_on_dataframe with SQL: the run's host builds the DataFrame in the ranks' session, which has the
    submitting session's settings (its time zone here), from 3 partitions of 10 rows for 2 ranks, and plans its
    shards as run_on_dataframe does; the submitter detaches, another handle attaches and gets rank 0's value:
    each rank had its own rows, every row once."""
    with connect_session(connect_durable.url) as spark:
        spark.conf.set("spark.sql.session.timeZone", "Asia/Tokyo")  # (the server's is this machine's)
        job = HorovodRunner(np=2, detached_timeout=300).submit_on_dataframe(
            horovod_ids, "SELECT id, current_timezone() AS tz FROM range(0, 10, 1, 3)", also="tz"
        )
        job_id = job.id
        job.close()
    with attach(job_id, logs=False) as job:
        views = job.wait(180)
    assert {view["shard"]: view["ids"] for view in views} == {0: [0, 1, 2, 3, 4], 1: [5, 6, 7, 8, 9]}
    assert sorted(view["rank"] for view in views) == [0, 1]
    assert [view["also"] for view in views] == [["Asia/Tokyo"], ["Asia/Tokyo"]]


def wait_until_gone(job_id: str, timeout: float = 60.0) -> JobNotFoundError:
    """The JobNotFoundError of ``attach(job_id)`` once the run's host has released its sessions."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            attach(job_id, logs=False).close()
        except JobNotFoundError as exc:
            return exc
        assert time.monotonic() < deadline, f"the run {job_id} was still there after {timeout:g}s"
        time.sleep(1)


def test_a_dataframe_the_runs_host_cannot_build_or_use_is_the_runs_error(connect_durable):
    """SQL naming a missing table, a callable whose DataFrame has no rows, and one that raises: each run's error
    names the problem (a LaunchError, as a launch's; the callable's error with its type), no rank started, and
    the run's sessions are gone once the outcome is fetched."""
    runner = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, detached_timeout=300)
    with connect_session(connect_durable.url):  # (one run at a time: each holds a task slot for its host)
        missing = runner.submit_on_dataframe(ask_for_a_shard, "SELECT x FROM no_such_table")
        with pytest.raises(LaunchError) as caught:
            missing.wait(180)
        text = str(caught.value)
        assert text.startswith("TorchDistributor: the run's host could not use the DataFrame of its SQL: "), text
        assert "TABLE_OR_VIEW_NOT_FOUND" in text.splitlines()[0] and "`no_such_table`" in text.splitlines()[0], text
        assert text.splitlines()[-1] == "SQL: SELECT x FROM no_such_table"
        status = missing.status()
        assert status.ended and status.ranks_started == 0 and status.cause == text.splitlines()[0]
        empty = runner.submit_on_dataframe(ask_for_a_shard, lambda spark: spark.range(0).selectExpr("id AS x"))
        with pytest.raises(LaunchError, match=r"DataFrame of the callable .*<lambda>: The DataFrame has no rows"):
            empty.wait(180)
        raising = runner.submit_on_dataframe(ask_for_a_shard, lambda spark: {}["no such key"])
        with pytest.raises(LaunchError, match=r"DataFrame of the callable .*<lambda>: KeyError: 'no such key'$"):
            raising.wait(180)
    for job in (missing, empty, raising):
        job_id = job.id
        job.close()
        assert "has ended" in str(wait_until_gone(job_id))


def logs_until_gate(gate: str) -> str | None:
    """Rank 0 reports a metric a step until ``gate`` exists, then logs one of its own with MLflow and returns the
    id of the MLflow run it logged into."""
    import os
    import time
    from pathlib import Path

    from airflow_provider_hvd import log_metrics

    rank, step = int(os.environ["HOROVOD_RANK"]), 0
    while not Path(gate).exists():
        if rank == 0:
            log_metrics(step, loss=1.0 / (step + 1))
        step += 1
        time.sleep(0.2)
    if rank != 0:
        return None
    import mlflow

    mlflow.log_metric("rank0_steps", step)
    return mlflow.active_run().info.run_id


def mlflow_run_named(job, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while job.mlflow_run_id is None:
        assert time.monotonic() < deadline, f"no MLflow run named within {timeout:g}s"
        time.sleep(0.2)
    return job.mlflow_run_id


def test_a_submitted_runs_mlflow_run_is_its_hosts_and_every_attach_goes_on_with_it(
    connect_durable, mlflow_auth_server, monkeypatch, gate, caplog
):
    """The run's host makes and ends its MLflow run, with the submitter's tracking server and credentials (the
    Connect server's executors have neither); a later attach names the same run, which ends FINISHED with every
    step rank 0 reported and rank 0's own logging."""
    from mlflow import MlflowClient

    from airflow_provider_hvd.runner.mlflow_settings import MlflowSettings

    server = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.username)  # this process's only
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    name, started = f"hvd-durable-{uuid.uuid4().hex[:8]}", []
    settings = MlflowSettings(tracking_uri=server.url, experiment_name=name, on_start=lambda *run: started.append(run))
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2, mlflow=settings).submit(logs_until_gate, gate=str(gate))
        run_id = mlflow_run_named(job)
        assert started == [(run_id, job.mlflow_run_url)]
        assert job.mlflow_run_url.startswith(f"{server.url}/#/experiments/") and job.mlflow_run_url.endswith(run_id)
        job.close()
        with attach(job.id) as again:
            assert mlflow_run_named(again) == run_id
            gate.touch()
            assert again.wait(180) == run_id  # rank 0 logged into the host's run
    client = MlflowClient(server.url)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED", run.info
    assert run.data.tags["hvd.runner"] == "HorovodRunner" and run.data.tags["hvd.spark_app_id"], run.data.tags
    steps = int(run.data.metrics["rank0_steps"])
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(steps))
    assert server.password not in caplog.text


def test_a_watcher_leaves_the_outcome_to_a_later_client_and_close_ends_a_wait(connect_durable, tmp_path, gate):
    """What Airflow's deferred task does: the submitter detaches (a wait in another thread then raises
    RunDetachedError), a watcher (fetch=False) relays the run to its end and leaves its outcome on the host, and
    a later attach() fetches rank 0's value."""
    from airflow_provider_hvd import RunDetachedError

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2).submit(train_until_gate, pid_dir=str(pid_dir), gate=str(gate))
    waited: list[BaseException] = []
    waiter = threading.Thread(target=lambda: waited.extend(catch(job.wait)), name="test-waiter")
    waiter.start()
    wait_for_pids(str(pid_dir), 2, timeout=120)
    job.close()
    waiter.join(30)
    assert len(waited) == 1 and isinstance(waited[0], RunDetachedError), waited
    assert "detached from it (job.close()); it goes on" in str(waited[0])
    watcher = attach(job.id, logs=False, fetch=False)
    assert watcher.status() == JobStatus("running", 2, 2)  # as the host said it before attach() returned
    with pytest.raises(Exception, match=r"this handle only watches \(fetch=False\): use watch\(\)"):
        watcher.wait()
    gate.touch()
    status = watcher.watch(120)
    watcher.close()
    assert status.ended and status.cause is None and status.size == 2
    value = attach(job.id, logs=False).wait(60)  # the watcher left it on the host
    assert value["rank"] == 0 and value["steps"] >= 1


def catch(call) -> list[BaseException]:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test reads which
        return [exc]
    return []


def test_refusals_are_one_sentence(connect_durable):
    with pytest.raises(LaunchError, match=r"a local run lives in this process and cannot outlive it; use run\(\)"):
        HorovodRunner(np=-2).submit(allreduce_sum)
    with pytest.raises(LaunchError, match=r"local_mode=True\)\.submit\(\): a local run lives in this process"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).submit(allreduce_sum)
    with connect_session(connect_durable.url) as spark:
        with pytest.raises(TypeError, match=r"submit_on_dataframe takes the DataFrame's recipe, not a DataFrame: "):
            HorovodRunner(np=2).submit_on_dataframe(allreduce_sum, spark.range(4))
        # local[3]: the user's np and the run's host, named apart
        with pytest.raises(
            HostSlotError,
            match=r"^HorovodRunner\(np=3\)'s 3 ranks fit the cluster at local\[3\] \(3 Spark task slots at most\), but "
            r"a submitted run needs 1 more for its host, which holds it for the whole run: 4 at once\. Give the "
            r"cluster one more task slot, lower np to at most 2, or use run\(\), whose supervisor is the calling",
        ):
            HorovodRunner(np=3).submit(allreduce_sum)
        with pytest.raises(
            LaunchError,
            match=r"^TorchDistributor\(num_processes=4\) needs 4 Spark task slots at once for its ranks and a "
            r"submitted run 1 more for its host, 5 in all \(a barrier job starts all its tasks together\), but the "
            r"cluster at local\[3\] has 3 at most \(spark.task.cpus=1\)\. Lower num_processes to at most 2 to submit "
            r"it \(or at most 3 with run\(\), which needs no slot for a host\), give the cluster more",
        ):
            TorchDistributor(num_processes=4, local_mode=False, use_gpu=False).submit(allreduce_sum)
    with pytest.raises(TypeError, match=r"takes the DataFrame's SQL \(a string\) or a callable .*, not int"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).submit_on_dataframe(allreduce_sum, 4)
    with pytest.raises(ValueError, match="is not a run's id: give job.id as submit"):
        attach("not an id")
    with pytest.raises(ValueError, match="detached_timeout must be a positive number of seconds"):
        HorovodRunner(np=2, detached_timeout=0)
    unknown = {
        "server": connect_durable.url,
        "session_id": str(uuid.uuid4()),
        "user_id": "",
        "tag": "horovod-runner-0",
        "runner": "HorovodRunner",
        "detached_timeout": 900.0,
    }
    with pytest.raises(JobNotFoundError, match=r"There is no run with the id .* holds no run"):
        attach(unknown)


def test_submit_on_classic_spark_says_what_to_use(spark_local):
    with pytest.raises(LaunchError, match=r"submit\(\) needs a Spark Connect session .* use run\(\) here"):
        HorovodRunner(np=2).submit(allreduce_sum)


def test_the_address_settings_the_host_never_takes_are_those_the_address_code_reads():
    """A submitted run's host is not the client: the settings of the client's own address (a container's
    driverHost, its published ports) stay out of the host's sessions. Held to what the address code reads over
    Spark Connect (spark.driver.host there is the server's: a session cannot change it)."""
    from airflow_provider_hvd.runner.driver.launch.address import (
        CLIENT_ADDRESS_SETTINGS,
        HOST_CONF,
        connect_driver_address,
    )

    read: set[str] = set()

    def conf(key: str) -> str | None:
        read.add(key)
        return None

    connect_driver_address(conf, "127.0.0.1", local=False)
    assert read - {HOST_CONF} == set(CLIENT_ADDRESS_SETTINGS)


def test_a_clients_own_address_settings_stay_with_the_client(connect_durable):
    """What docs/guide/driver-ports.md tells a client in a container to set (the address the agents are told,
    where it listens, fixed ports) is the client's: the run's host in the cluster listens where it is, and the
    client's session keeps its settings."""
    from spark_cluster import free_port

    from airflow_provider_hvd.runner.driver.launch.address import CLIENT_ADDRESS_SETTINGS

    with connect_session(connect_durable.url) as spark:
        values = ["192.0.2.1", "192.0.2.1", str(free_port()), str(free_port())]  # (host, bind, the two ports)
        own = dict(zip(CLIENT_ADDRESS_SETTINGS, values, strict=True))
        for key, value in own.items():
            spark.conf.set(key, value)
        with HorovodRunner(np=2).submit(allreduce_sum, base=1.0) as job:
            assert job.wait(180) == {"rank": 0, "size": 2, "local_size": 2, "sum": 5.0}
        assert {key: spark.conf.get(key) for key in own} == own


def test_a_submitted_run_has_the_sessions_secret_settings_and_credentials_and_the_server_logs_none(
    connect_durable, mlflow_auth_server, monkeypatch, tmp_path
):
    """The ranks' session has every setting of the submitting session, secrets included, and its temporary views:
    a Hadoop setting named like a secret (Spark's redaction hides it from the session's own clients) mounts the
    files of the view the recipe reads; the host makes the MLflow run with the submitter's credentials; and none
    of the secrets (an object store's key, MLflow's password) is in the Connect server's log, where it logs an
    operation's whole plan."""
    from mlflow import MlflowClient

    from airflow_provider_hvd.runner.mlflow_settings import MlflowSettings

    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "ids.txt").write_text("\n".join(str(i) for i in range(6)) + "\n")
    table = f"secret{uuid.uuid4().hex[:8]}"  # a viewfs mount table: its setting's name matches the redaction
    account_key = f"hvd-key-{uuid.uuid4().hex}"  # an object store's key whose name the redaction does not match
    server = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.username)  # this process's only
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    name = f"hvd-secrets-{uuid.uuid4().hex[:8]}"
    with connect_session(connect_durable.url) as spark:
        spark.conf.set(f"fs.viewfs.mounttable.{table}.link./rows", rows.as_uri())
        spark.conf.set("fs.viewfs.impl.disable.cache", "true")  # (a cached mount would hide a missing setting)
        spark.conf.set("fs.azure.account.key.hvdtest.dfs.core.windows.net", account_key)
        ids = spark.sql(f"SELECT CAST(value AS BIGINT) AS id FROM text.`viewfs://{table}/rows/ids.txt`")
        ids.createOrReplaceTempView("secret_ids")
        runner = HorovodRunner(np=2, mlflow=MlflowSettings(tracking_uri=server.url, experiment_name=name))
        with runner.submit_on_dataframe(horovod_ids, "SELECT id FROM secret_ids") as job:
            views = job.wait(180)
            run_id = job.mlflow_run_id
    wait_until_gone(job.id)  # (the host releases its sessions once the value was fetched: the server logs then)
    assert {view["shard"]: view["ids"] for view in views} == {0: [0, 1, 2], 1: [3, 4, 5]}
    client = MlflowClient(server.url)
    assert client.get_run(run_id).info.status == "FINISHED"
    # a released session's running operation is logged whole (the host's is one), once the server closed it
    until(lambda: "python_udf" in connect_durable.log_file.read_text(errors="replace"), 30, "the host's plan logged")
    log = connect_durable.log_file.read_text(errors="replace")
    for secret in (account_key, server.password):
        assert secret not in log


def until(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(0.2)


class LinkProxy:
    """A TCP relay put in a run's session in the place of its host's link (what a client reads to attach): it
    counts the bytes the host sends each connection through it (``received``, in the order they came), and cuts the
    next one once the host sent it ``cut_after`` bytes (a network that drops). TLS and the handshake pass through."""

    def __init__(self, url: str, job_id: str) -> None:
        self._session = open_session(run_connection(url), json.loads(job_id)["session_id"])
        self._published = str(self._session.conf.get(LINK_CONF))
        self.target = LinkAddress.from_conf(self._published)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.received: list[int] = []
        self.cut_after: int | None = None
        relayed = dataclasses.replace(self.target, host="127.0.0.1", port=self._listener.getsockname()[1])
        self._session.conf.set(LINK_CONF, relayed.to_conf())
        threading.Thread(target=self._serve, name="test-link-proxy", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host = socket.create_connection((self.target.host, self.target.port))
            index, cut = len(self.received), self.cut_after
            self.received.append(0)
            self.cut_after = None
            threading.Thread(target=self._pump, args=(client, host, None, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(host, client, index, cut), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, index: int | None, cut: int | None) -> None:
        try:
            while data := source.recv(1 << 16):
                last = cut is not None and index is not None and self.received[index] + len(data) >= cut
                if last:
                    data = data[: cut - self.received[index]]
                if index is not None:  # (counted before it is passed on: the client may hold it as sendall returns)
                    self.received[index] += len(data)
                sink.sendall(data)
                if last:
                    break
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        with contextlib.suppress(Exception):  # (the run's session may be gone: its outcome fetched)
            self._session.conf.set(LINK_CONF, self._published)
        self._session.client.close()


def test_a_finished_runs_outcome_is_kept_past_its_lease_until_fetched_and_a_watcher_never_downloads_it(
    connect_durable,
):
    """A run returning 20 MiB ends while its submitter is attached; the submitter detaches without fetching. A
    watcher (Airflow's trigger) gets the outcome but not the value; nobody is attached for longer than the run's
    detached_timeout (the lease ends a running run only), then a fetching attach gets the value, though its link
    drops half-way through it (it attaches again); once it holds the value the host lets the run go."""
    megabytes = 20
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2, detached_timeout=3).submit(big_value, megabytes=megabytes)
        until(lambda: job.status().ended, what="the run's end")
        job.close()  # (its link had the value too: it never fetched it, the host keeps it)
    with LinkProxy(connect_durable.url, job.id) as proxy:
        with attach(job.id, fetch=False) as watcher:
            status = watcher.watch(60)
        assert status == JobStatus("ended", 2, 2, None)
        assert proxy.received[0] < 64 << 10, f"the watcher received {proxy.received[0]} bytes"
        time.sleep(3 + 2)  # nobody attached for longer than detached_timeout: a time, nothing to observe
        proxy.cut_after = 1 << 20  # the next link drops once 1 MiB of the value came
        with attach(job.id, logs=False) as fetcher:
            assert fetcher.wait(120) == value_of(megabytes)
        assert len(proxy.received) == 3 and proxy.received[1] == 1 << 20, proxy.received
        assert proxy.received[2] > megabytes << 20, proxy.received  # attached again: the whole outcome
    assert "has ended: its Spark Connect session was closed" in str(wait_until_gone(job.id))  # fetched: released


def test_an_outcome_nobody_fetches_is_dropped_after_outcome_timeout_and_no_released_session_is_renewed(
    connect_durable, monkeypatch, caplog
):
    """A run's submitter stays attached after the end and never fetches: its host keeps the outcome for its
    outcome_timeout (whoever is attached), renewing only the sessions it still has, then releases the run's; a
    later attach says why it found nothing."""
    monkeypatch.setattr(submit_module, "SESSION_KEEPALIVE_S", 0.5)  # the host renews its sessions this often
    with connect_session(connect_durable.url):
        job = HorovodRunner(np=2, outcome_timeout=4).submit(allreduce_sum, base=1.0)
        until(lambda: job.status().ended, what="the run's end")
        exc = wait_until_gone(job.id)
        job.close()
    assert "outcome_timeout of 4s" in str(exc) and "nothing of it is left on the server" in str(exc), exc
    assert "could not renew the Spark Connect session" not in caplog.text  # (relayed from the host's log)


def test_a_host_that_cannot_start_or_was_lost_is_named_by_submit_and_nothing_of_it_is_left(connect_durable):
    """Forced, through what the Airflow operator does as a run is submitted (its announce: the run's session is
    there, its host not yet): the run's session says to listen on an address of no host here, so its host cannot
    start; a second run's session says its host was lost (what a later attempt of the host's task writes, as if
    the first attempt died before it published its link). submit() names each cause; nothing is left."""
    from airflow_provider_hvd.runner.driver.launch.address import CONNECT_BIND_CONF

    connection, ids = run_connection(connect_durable.url), []

    def unlistenable(job_id: str) -> None:
        ids.append(job_id)
        run = open_session(connection, json.loads(job_id)["session_id"])
        run.conf.set(CONNECT_BIND_CONF, "192.0.2.1")
        run.client.close()

    def lost(job_id: str) -> None:
        ids.append(job_id)
        session_id = json.loads(job_id)["session_id"]
        catch(lambda: later_attempt("HorovodRunner", connection, session_id, LIVENESS, start_wait=0))

    runner = HorovodRunner(np=2)
    with connect_session(connect_durable.url):
        with runner._announcing(unlistenable), pytest.raises(LaunchError) as caught:
            runner.submit(allreduce_sum)
        text = str(caught.value)
        assert text.startswith("HorovodRunner: the run's host could not start over Spark Connect sc://"), text
        assert "cannot listen for its clients on 192.0.2.1 (spark.horovodRunner.driverBindAddress=192.0.2.1)" in text
        with runner._announcing(lost), pytest.raises(LaunchError) as caught:
            runner.submit(allreduce_sum)
        text = str(caught.value)
        assert re.search(r"could not start over .*: the run's host was lost \(its task or executor failed\)", text)
    for job_id in ids:
        with pytest.raises(JobNotFoundError, match=r"has ended: its Spark Connect session was closed"):
            attach(job_id)


def test_a_notebooks_submit_shows_the_ranks_lines_and_the_next_attach_goes_on_after_them(
    connect_durable, tmp_path, gate
):
    """A notebook with no logging set up submits, sleeps, reads the status and closes: the ranks' lines reach its
    stderr while it is attached; the next attach().wait() resumes after the last line shown there, none lost."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    notebook = Client("notebook", connect_durable.url, pid_dir, gate)
    attacher = None
    try:
        job_id = notebook.wait_for("JOB_ID ").split("JOB_ID ", 1)[1]
        status = notebook.wait_for("STATUS ")
        assert "phase='running', ranks_started=2, size=2" in status, status
        notebook.wait_for("CLOSED")
        notebook.stop()
        shown = rank_steps(notebook.lines)
        assert {"rank 0 step 0", "rank 1 step 0"} <= set(shown), notebook.lines
        attacher = Client("attach", job_id)
        attacher.wait_for("[rank 0] rank 0 step")
        gate.touch()
        attacher.wait_for("VALUE ")
        # (a batch shown as the notebook closed may come again: it could not acknowledge it)
        assert_no_line_lost(shown, rank_steps(attacher.lines))
    finally:
        notebook.stop()
        if attacher is not None:
            attacher.stop()


def test_an_attach_to_a_run_whose_host_waits_for_a_slot_waits_for_it(connect_durable, tmp_path):
    """The server's 3 slots are held by another session's job when a run is submitted: its host's one task
    waits. An attach then (a retry of the submitting task, once the run's id is in the task state store) gives a
    handle that waits for the host, not JobNotFoundError (the caller would submit a second run beside the first);
    once the slots are free the run trains and both handles get rank 0's value."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from airflow_provider_hvd.runner.driver.launch.spark.connect_client import running_operations

    release, started = tmp_path / "release", tmp_path / "held"
    started.mkdir()
    connection = run_connection(connect_durable.url)
    holder = ConnectSession.builder.remote(connect_durable.url).create()  # another session's job holds every slot
    hold = holder.range(3, numPartitions=3).mapInArrow(hold_slots_until(str(release), str(started)), "id long")
    held = threading.Thread(target=hold.collect, name="test-holder")
    attached: list = []

    def attach_while_queued(job_id: str) -> None:
        try:
            run = open_session(connection, json.loads(job_id)["session_id"])
            # the run's operation is there, its host's task waiting for a slot (a conf read makes the session known)
            until(lambda: run.conf.get(LINK_CONF, None) is None and running_operations(run), what="the operation")
            run.client.close()
            started_at = time.monotonic()
            job = attach(job_id, logs=False)
            attached.append(time.monotonic() - started_at)
            attached.append(job.status())
            attached.append(catch(lambda: job.wait(1)))
            release.touch()
            attached.append(job.wait(120))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            attached.append(exc)
            release.touch()

    runner = HorovodRunner(np=2)
    attacher = None
    try:
        held.start()
        until(lambda: len(list(started.iterdir())) == 3, what="the holder's 3 tasks")
        with connect_session(connect_durable.url):

            def announce(job_id: str) -> None:  # (as the operator does: the run's id, before its host starts)
                nonlocal attacher
                attacher = threading.Thread(target=attach_while_queued, args=(job_id,), name="test-attacher")
                attacher.start()

            with runner._announcing(announce):
                job = runner.submit(allreduce_sum, base=1.0)  # (returns once its host started)
            value = job.wait(120)
        assert attacher is not None
        attacher.join(120)
        assert len(attached) == 4, attached
        took, status, waited, other_value = attached
        assert took < 30 and status.phase == "starting", attached
        assert len(waited) == 1 and isinstance(waited[0], TimeoutError), waited
        assert "its host has not started yet" in str(waited[0])
        assert value == other_value == {"rank": 0, "size": 2, "local_size": 2, "sum": 5.0}
    finally:
        release.touch()
        held.join(60)
        holder.stop()
