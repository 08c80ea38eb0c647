"""In-run restarts (``max_restarts``): a run whose rank is killed starts again from its last checkpoint within the
same ``run()``, locally and on the standalone cluster of two workers; an exception of ``main`` is not restarted;
nothing of an attempt is left when the next starts; a cancel between attempts ends the run."""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
from pathlib import Path

import pytest
from conftest import make_session
from connect_server import connect_session
from jobs import alive, assert_all_gone, no_spark_job_left
from mlflow import MlflowClient
from restart_jobs import fail_each_attempt, train_until_killed
from test_dataframe_feed import holders

from airflow_provider_hvd import HorovodRunner, LaunchError, RankFailedError, RunCancelledError, TorchDistributor
from airflow_provider_hvd.runner.driver.restarts.policy import RestartPolicy
from airflow_provider_hvd.runner.errors import CauseKind
from airflow_provider_hvd.runner.mlflow_settings import MlflowSettings

RESTART_LINE = (
    r"{runner}: restart 1 of 2 after {kind} rank 1 of 2 failed: was killed by SIGKILL without a Python "
    r"exception: resuming from {ckpt}/epoch-3\.pt \(epoch=3\){reported}"
)


def pids(pid_dir: Path, pattern: str) -> list[int]:
    return [int(path.read_text()) for path in pid_dir.glob(pattern)]


def ours(temp: Path) -> list[str]:
    """What the runs left in ``temp`` (torch keeps its own cache there, torchinductor_<user>)."""
    return [path.name for path in temp.iterdir() if path.name.startswith("hvd-")]


def runner_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "airflow_provider_hvd.runner"]


class Sink:
    """A progress sink that keeps the restarts too (as an Airflow task's would), of the try it says."""

    try_number = 4

    def __init__(self) -> None:
        self.checkpoints: list[dict] = []
        self.attempts: list[dict] = []

    def metrics(self, snapshot: dict) -> None:
        pass

    def checkpoint(self, record: dict) -> None:
        self.checkpoints.append(record)

    def restarts(self, records: list[dict]) -> None:
        self.attempts = records


@pytest.fixture
def temp(tmp_path, monkeypatch) -> Path:
    """TMPDIR of the local ranks and their reapers (and of this process's agents): what a run leaves there."""
    path = tmp_path / "temp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def dirs(tmp_path: Path) -> tuple[str, Path]:
    (tmp_path / "ckpt").mkdir(parents=True)
    (tmp_path / "pids").mkdir()
    return str(tmp_path / "ckpt"), tmp_path / "pids"


LOCAL_TORCH = {"num_processes": 2, "local_mode": True, "use_gpu": False}


@pytest.fixture(scope="module")
def never_failed(tmp_path_factory) -> str:
    """The final weights (their SHA-256) of the training that never failed: torch DDP on 2 local processes. Horovod's
    are the same, bit for bit: the average of two gradients is exact whichever way it is taken (DDP's g0/2 + g1/2,
    Horovod's (g0 + g1)/2), so both take the same steps."""
    ckpt, pid_dir = dirs(tmp_path_factory.mktemp("never-failed"))
    reference = TorchDistributor(**LOCAL_TORCH).run(train_until_killed, ckpt, str(pid_dir), "torch")
    assert reference["epochs_trained"] == [1, 2, 3, 4, 5]
    return reference["weights_sha256"]


def test_a_rank_killed_after_a_checkpoint_restarts_from_it_to_the_weights_of_a_run_that_never_failed(
    never_failed, tmp_path, temp, caplog
):
    """TorchDistributor, local: torch DDP over gloo on 2 processes, rank 1 SIGKILLed after epoch 3's checkpoint.
    Before: run() raised RankFailedError (max_restarts was no setting)."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    ckpt, pid_dir = dirs(tmp_path / "killed")
    sink = Sink()
    tracking = f"sqlite:///{tmp_path}/mlflow.db"  # (a local store: no tracking server on this module's worker)
    mlflow = MlflowSettings(tracking_uri=tracking, experiment_name="restarts")
    distributor = TorchDistributor(**LOCAL_TORCH, max_restarts=2, progress_sink=sink, mlflow=mlflow)
    result = distributor.run(train_until_killed, ckpt, str(pid_dir), "torch", kill_after_epoch=3)
    assert result["resumed_from"]["path"] == f"{ckpt}/epoch-3.pt" and result["resumed_from"]["epoch"] == 3
    assert result["resumed_from"]["try_number"] == Sink.try_number  # (a task's try reported it)
    # the sink's restarts: each attempt's record and where it starts on the curve (its first step)
    steps = zip(distributor.attempts, (1, 4), strict=True)
    assert sink.attempts == [{**record, "first_step": step} for record, step in steps]
    assert sink.checkpoints[-1]["epoch"] == 5
    assert result["epochs_trained"] == [4, 5]
    assert result["weights_sha256"] == never_failed
    assert result["earlier_alive"] == [], "attempt 1's ranks still ran when attempt 2 started"

    first, second = distributor.attempts
    assert first["cause_kind"] == CauseKind.SIGNAL and "rank 1 of 2 failed: was killed by SIGKILL" in first["cause"]
    assert first["resumed_from"] is None and first["size"] == 2
    assert second["cause_kind"] is None and second["resumed_from"]["epoch"] == 3
    assert distributor.checkpoint["path"] == f"{ckpt}/epoch-5.pt"
    assert [step for step, _ in distributor.metrics["loss"]] == [1, 2, 3, 4, 5]
    restart = RESTART_LINE.format(
        runner="TorchDistributor", kind="torch.distributed", ckpt=re.escape(ckpt), reported=", reported by try 4"
    )
    assert [line for line in runner_lines(caplog) if re.fullmatch(restart, line)], runner_lines(caplog)
    assert "[rank 1] epoch 3 done" in caplog.text and "[rank 1, attempt 2] epoch 4 done" in caplog.text
    assert "[rank 1, attempt 2] epoch 3" not in caplog.text
    assert_all_gone(pids(pid_dir, "*.pid"))
    assert ours(temp) == []
    # one MLflow run holds both attempts: every epoch's loss, the restart as a metric, each attempt as a tag
    client = MlflowClient(tracking)
    run = client.get_run(distributor.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "hvd.restarts")] == [(1, 1.0)]
    tags = {n: json.loads(run.data.tags[f"hvd.attempt.{n}"]) for n in (1, 2)}
    assert tags[1]["cause_kind"] == "signal" and tags[1]["cause"] == first["cause"] and tags[1]["ended_at"]
    assert tags[2]["resumed_from"] == f"{ckpt}/epoch-3.pt (epoch=3), reported by try 4"
    assert tags[2]["cause"] is None and tags[2]["ended_at"] == second["ended_at"]


def test_an_exception_in_main_ends_the_run_in_one_attempt_saying_why(tmp_path, temp):
    """A ValueError is the code's own: a new attempt would raise it again."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2, max_restarts=2).run(fail_each_attempt, pid_dir=str(pid_dir))
    error = info.value
    first, second = str(error).splitlines()[:2]
    assert first == "Horovod rank 1 of 2 failed: ValueError: boom in attempt 1"
    assert second == (
        "Not restarted (max_restarts=2): the cause is the code's own exception in main, which a new attempt would "
        "raise again (restart_on_exceptions names the exception types a run restarts on)."
    )
    assert error.cause_kind is CauseKind.EXCEPTION and error.exception_types[0] == "builtins.ValueError"
    assert [record["cause_kind"] for record in error.attempts] == ["exception"]
    assert sorted(path.name for path in pid_dir.iterdir()) == ["1-rank-0.pid", "1-rank-1.pid"]
    assert_all_gone(pids(pid_dir, "*.pid"))


def test_restart_on_exceptions_restarts_on_the_exceptions_it_names_until_the_budget_is_spent(tmp_path, temp):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runner = HorovodRunner(np=-2, max_restarts=1, restart_on_exceptions=["Exception"])  # ValueError's base
    with pytest.raises(RankFailedError) as info:
        runner.run(fail_each_attempt, pid_dir=str(pid_dir))
    lines = str(info.value).splitlines()
    assert lines[:4] == [
        "Horovod rank 1 of 2 failed: ValueError: boom in attempt 2",
        "Not restarted: its 1 restart(s) are spent (max_restarts=1). 2 attempts ran:",
        "  attempt 1 (2 ranks, from the start): Horovod rank 1 of 2 failed: ValueError: boom in attempt 1 [exception]",
        "  attempt 2 (2 ranks, from the start): Horovod rank 1 of 2 failed: ValueError: boom in attempt 2 [exception]",
    ]
    assert len(runner.attempts) == 2 and info.value.attempts == runner.attempts
    assert len(list(pid_dir.iterdir())) == 4
    assert_all_gone(pids(pid_dir, "*.pid"))


def test_a_cancel_between_attempts_ends_the_run(tmp_path, temp, caplog):
    """The cancel comes as the run says its restart, before the next attempt starts (the timing forced: the log
    handler runs in the run's own thread)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runner = HorovodRunner(np=-2, max_restarts=2)

    class CancelOnRestart(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "restart 1 of 2" in record.getMessage():
                runner.cancel()

    handler = CancelOnRestart()
    logging.getLogger("airflow_provider_hvd.runner").addHandler(handler)
    try:
        with pytest.raises(RunCancelledError) as info:
            runner.run(fail_each_attempt, pid_dir=str(pid_dir), how="kill")
    finally:
        logging.getLogger("airflow_provider_hvd.runner").removeHandler(handler)
    assert str(info.value) == (
        "HorovodRunner: the run was cancelled between attempts: attempt 1 had ended (Horovod rank 1 of 2 failed: "
        "was killed by SIGKILL without a Python exception), and no attempt 2 started; every rank was ended"
    )
    assert [record["attempt"] for record in runner.attempts] == [1]
    assert sorted(path.name for path in pid_dir.iterdir()) == ["1-rank-0.pid", "1-rank-1.pid"]
    assert_all_gone(pids(pid_dir, "*.pid"))


def test_the_policy_restarts_on_causes_not_the_codes_own_and_on_the_exceptions_it_names():
    def error(kind: CauseKind, *classes: str) -> RankFailedError:
        failed = RankFailedError(
            "x", rank=1, exit_code=1, remote_traceback=None, output_tail=[], other_failures=[], exception_types=classes
        )
        failed.cause_kind = kind
        return failed

    policy = RestartPolicy(2)
    restarted = [kind for kind in CauseKind if policy.why_not(error(kind)) is None]
    assert set(restarted) == {
        *("signal", "oom", "agent_lost", "host_lost", "peer_lost", "stall", "not_started", "spark_job", "preempted")
    }
    oom = ("torch.OutOfMemoryError", "builtins.RuntimeError", "builtins.Exception")
    named = RestartPolicy(2, ("RuntimeError",))
    assert named.why_not(error(CauseKind.EXCEPTION, *oom)) is None
    assert RestartPolicy(2, ("torch.OutOfMemoryError",)).why_not(error(CauseKind.EXCEPTION, *oom)) is None
    assert RestartPolicy(2, ("Error",)).why_not(error(CauseKind.EXCEPTION, *oom)) is not None
    assert named.why_not(error(CauseKind.EXCEPTION, "builtins.ValueError", "builtins.Exception")) is not None
    assert named.why_not(error(CauseKind.EXIT)) is not None  # an exit is no exception


def test_over_spark_connect_each_attempt_is_a_barrier_job_of_its_own_until_the_budget_is_spent(connect_local, tmp_path):
    """Rank 1 is SIGKILLed in every attempt, on the local Connect server (whose run's channel is TLS)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with connect_session(connect_local), pytest.raises(RankFailedError) as info:
        HorovodRunner(np=2, max_restarts=1).run(fail_each_attempt, pid_dir=str(pid_dir), how="kill")
    lines = str(info.value).splitlines()
    assert lines[0] == "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception"
    assert lines[1] == "Not restarted: its 1 restart(s) are spent (max_restarts=1). 2 attempts ran:"
    assert [record["cause_kind"] for record in info.value.attempts] == ["signal", "signal"]
    assert sorted(path.name for path in pid_dir.iterdir()) == [f"{n}-rank-{r}.pid" for n in (1, 2) for r in (0, 1)]
    assert_all_gone(pids(pid_dir, "*.pid"))


# --- on the standalone cluster of two 1-core workers ---


@pytest.fixture(scope="module")
def cluster_temp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("executors-temp")


@pytest.fixture(scope="module")
def cluster_session(standalone_cluster, cluster_temp):
    """An application on both workers whose ranks' TMPDIR is the module's folder (what a run leaves there)."""
    spark = make_session(
        standalone_cluster.url,
        **{
            "spark.executor.cores": "1",
            "spark.cores.max": "2",
            "spark.executorEnv.TMPDIR": str(cluster_temp),
            **standalone_cluster.app_conf,
        },
    )
    yield spark
    spark.stop()


def test_on_spark_a_killed_rank_restarts_in_a_new_barrier_job_once_the_last_one_is_gone(
    never_failed, standalone_cluster, cluster_session, cluster_temp, tmp_path, temp, monkeypatch, caplog
):
    """HorovodRunner(np=2) on the standalone cluster, on a DataFrame: rank 1 SIGKILLed after epoch 3's checkpoint.
    When attempt 2 ships its job, attempt 1's ranks, Spark jobs and broadcast are gone; each attempt gets every row
    once; the weights are those of the run that never failed."""
    from pyspark import SparkContext

    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    sc = cluster_session.sparkContext
    ckpt, pid_dir = dirs(tmp_path / "killed")
    broadcasts: list = []
    seen_at_ship: list[dict] = []
    broadcast = SparkContext.broadcast

    def recorded(self, value):
        seen_at_ship.append(
            {
                "broadcasts_valid": [b._jbroadcast.isValid() for b in broadcasts],
                "active_jobs": list(self.statusTracker().getActiveJobsIds()),
                "active_stages": list(self.statusTracker().getActiveStageIds()),
                "ranks_alive": [pid for pid in pids(pid_dir, "from-*.pid") if alive(pid)],
            }
        )
        broadcasts.append(broadcast(self, value))
        return broadcasts[-1]

    monkeypatch.setattr(SparkContext, "broadcast", recorded)
    df = cluster_session.range(0, 90, numPartitions=3)
    runner = HorovodRunner(np=2, max_restarts=2)
    result = runner.run_on_dataframe(
        train_until_killed, df, ckpt_dir=ckpt, pid_dir=str(pid_dir), kill_after_epoch=3, shard=True
    )
    assert result["resumed_from"]["epoch"] == 3 and result["epochs_trained"] == [4, 5]
    assert result["rows"] == list(range(90)) and result["earlier_alive"] == []
    assert [record["cause_kind"] for record in runner.attempts] == ["signal", None]
    assert seen_at_ship == [
        {"broadcasts_valid": [], "active_jobs": [], "active_stages": [], "ranks_alive": []},
        {"broadcasts_valid": [False], "active_jobs": [], "active_stages": [], "ranks_alive": []},
    ]
    restart = RESTART_LINE.format(runner="HorovodRunner", kind="Horovod", ckpt=re.escape(ckpt), reported="")
    assert [line for line in runner_lines(caplog) if re.fullmatch(restart, line)], runner_lines(caplog)

    monkeypatch.setattr(SparkContext, "broadcast", broadcast)
    assert not broadcasts[1]._jbroadcast.isValid()
    assert no_spark_job_left(cluster_session)
    assert_all_gone(pids(pid_dir, "*.pid"))
    shards = [path.read_text() for path in pid_dir.glob("*.shard")]
    assert len(shards) == 4 and all(holders(link) == [] for link in shards), shards
    assert ours(cluster_temp) == []
    assert result["weights_sha256"] == never_failed
    executors = "".join(
        path.read_text() for path in standalone_cluster.workdir.glob(f"worker-*/{sc.applicationId}/*/stderr")
    )
    assert "[rank 1] epoch 3 done" in executors and "[rank 1, attempt 2] epoch 4 done" in executors


def test_on_spark_an_exception_in_main_ends_the_run_in_one_barrier_job(cluster_session, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runner = HorovodRunner(np=2, max_restarts=2)
    with pytest.raises(RankFailedError, match=r"^Horovod rank 1 of 2 failed: ValueError: boom in attempt 1\n"):
        runner.run(fail_each_attempt, pid_dir=str(pid_dir))
    assert [record["cause_kind"] for record in runner.attempts] == ["exception"]
    assert sorted(path.name for path in pid_dir.iterdir()) == ["1-rank-0.pid", "1-rank-1.pid"]
    assert_all_gone(pids(pid_dir, "*.pid"))


def test_a_restart_below_min_ranks_fails_after_the_bounded_wait_saying_what_it_waited_for(cluster_session):
    """The restart's wait for task slots on the standalone cluster's 2: 3 ranks with min_ranks=2 start as 2 once
    shrink_timeout has passed; with min_ranks=3 the wait ends after slot_wait_timeout with an error that says
    what it waited for and how to go on (the runner's door to it, a lost host, is test_hosts.py's). Before: it
    ended after shrink_timeout where that was longer (30 s for a 1 s slot_wait_timeout, the error saying 1 s)."""
    from airflow_provider_hvd.runner.driver.launch.spark.capacity import ClassicSlots, wait_for_restart_slots

    count = ClassicSlots(cluster_session.sparkContext)
    deadline = time.monotonic() + 120
    while count.now() != (2, 0):  # the application's two executors registered, idle (run alone: they start now)
        assert time.monotonic() < deadline, count.now()
        time.sleep(0.2)
    assert wait_for_restart_slots(count, 3, 2, 0.0, 1.0, lambda: False) == 2
    with pytest.raises(LaunchError) as failed:  # (no fewer ranks to wait for: shrink_timeout, 30 s, does not apply)
        wait_for_restart_slots(count, 3, 3, 30.0, 1.0, lambda: False)
    assert re.fullmatch(
        r"waited [1-9]s for 3 ranks' free Spark task slots \(min_ranks=3 of HorovodRunner\(np=3\)\) on spark://\S+, "
        r"and the application has 2 free\. Set min_ranks lower to go on with fewer ranks, give the cluster more "
        r"executors, or wait longer \(slot_wait_timeout, now 1s\)\.",
        str(failed.value),
    ), str(failed.value)


def test_max_restarts_and_restart_on_exceptions_are_checked():
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="max_restarts must be a whole number >= 0"):
            HorovodRunner(np=2, max_restarts=bad)
    with pytest.raises(TypeError, match="restart_on_exceptions takes exception types or their names"):
        TorchDistributor(restart_on_exceptions=[3], use_gpu=False)
    assert TorchDistributor(restart_on_exceptions=ValueError, use_gpu=False).restart_on_exceptions == (
        "builtins.ValueError",
    )
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="min_ranks must be a whole number >= 1"):
            HorovodRunner(np=2, min_ranks=bad)
    with pytest.raises(ValueError, match=r"min_ranks=3 is more than the run's num_processes=2: .* at most 2$"):
        TorchDistributor(num_processes=2, min_ranks=3, use_gpu=False)
    with pytest.raises(ValueError, match="shrink_timeout must be a number of seconds >= 0"):
        HorovodRunner(np=2, shrink_timeout=-1)
    with pytest.raises(ValueError, match=r"\(min_ranks=1\)\.submit\(\): a submitted run restarts with all"):
        HorovodRunner(np=2, min_ranks=1).submit(print)
