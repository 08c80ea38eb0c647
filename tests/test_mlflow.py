"""The runners' MLflow runs (mlflow=...), against a real tracking server (the mlflow_server fixture), read back
with MLflow's client."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import urllib.parse
import uuid

import pytest
from cancels import CancelAtLaunch
from mlflow import MlflowClient
from test_channel_tls import RecordingProxy

from airflow_provider_hvd.runner import HorovodRunner, RankFailedError, RunCancelledError, TorchDistributor
from airflow_provider_hvd.runner.driver.tracking import mlflow_run
from airflow_provider_hvd.runner.mlflow_settings import MlflowSettings, mlflow_settings
from airflow_provider_hvd.runner.shared.messages import Metrics
from airflow_provider_hvd.runner.shared.timing import FINAL_WRITE_S

RUNNER_LOG = "airflow_provider_hvd.runner"


def experiment() -> str:
    return f"hvd-tests-{uuid.uuid4().hex[:8]}"


def runs_of(client: MlflowClient, name: str):
    found = client.get_experiment_by_name(name)
    return [] if found is None else client.search_runs([found.experiment_id])


@pytest.fixture
def runner_log():
    """``runner_log(handler)`` adds a handler to the runner's logger for the test; removed as it ends."""
    logger, added = logging.getLogger(RUNNER_LOG), []

    def add(handler: logging.Handler) -> None:
        logger.addHandler(handler)
        added.append(handler)

    yield add
    for handler in added:
        logger.removeHandler(handler)


def mlflow_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "MLflow" in r.getMessage()]


def tracked_training():
    import os

    from airflow_provider_hvd.runner import log_metrics, report_checkpoint

    rank = int(os.environ["HOROVOD_RANK"])
    if rank != 0:  # the other ranks know nothing of the run: they cannot log into it by mistake
        assert not {"MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"} & set(os.environ), "rank 1 got the MLflow run"
        return None
    for step in (1, 2, 3):
        log_metrics(step, loss=1.0 / step, acc=0.5)
    report_checkpoint("/ckpt/epoch-3.pt", epoch=3)
    import mlflow

    given = os.environ["MLFLOW_RUN_ID"]  # (MLflow takes it out of the environment as it resumes the run)
    mlflow.log_param("lr", 0.1)  # rank 0's own logging lands in the runner's run
    return given, mlflow.active_run().info.run_id


def test_a_run_is_one_mlflow_run_with_its_settings_metrics_checkpoint_and_rank0s_own_logging(mlflow_server):
    name, started = experiment(), []
    settings = MlflowSettings(
        tracking_uri=mlflow_server,
        experiment_name=name,
        run_name="nightly",
        tags={"team": "vision"},
        on_start=lambda run_id, url: started.append((run_id, url)),
    )
    runner = HorovodRunner(np=-2, mlflow=settings)
    given, logged_into = runner.run(tracked_training)

    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, name)  # one run: the other rank made none
    assert given == logged_into == run.info.run_id == runner.mlflow_run_id
    assert started == [(run.info.run_id, runner.mlflow_run_url)]
    assert runner.mlflow_run_url == f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert run.info.status == "FINISHED" and run.info.run_name == "nightly"
    assert {"np": "-2", "driver_log_verbosity": "log_callback_only", "lr": "0.1"}.items() <= run.data.params.items()
    tags = run.data.tags
    assert {"team": "vision", "hvd.runner": "HorovodRunner", "hvd.np": "2"}.items() <= tags.items()
    assert tags["hvd.checkpoint.path"] == "/ckpt/epoch-3.pt" and '"epoch": 3' in tags["hvd.checkpoint.info"]
    assert "hvd.failure" not in tags and "hvd.spark_app_id" not in tags  # (a local run has no Spark application)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert len(client.get_metric_history(run.info.run_id, "acc")) == 3


def many_steps(steps):
    import os

    from airflow_provider_hvd.runner import log_metrics

    if int(os.environ["HOROVOD_RANK"]) != 0:
        return None
    for step in range(steps):
        log_metrics(step, loss=1.0 / (step + 1))
    import mlflow

    mlflow.log_param("on_spark", True)  # rank 0 on an executor logs into the run too
    return None


def test_on_spark_the_run_has_the_application_and_its_metrics_come_in_a_few_batches(
    spark_local, mlflow_server, monkeypatch
):
    batches = []
    log_batch = MlflowClient.log_batch

    def counted(self, run_id, metrics=(), **kwargs):
        if metrics:
            batches.append(len(metrics))
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)  # counts the driver's calls; each still made
    name = experiment()
    runner = HorovodRunner(np=2, mlflow={"tracking_uri": mlflow_server, "experiment_name": name})
    runner.run(many_steps, steps=300)
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, name)
    assert run.data.tags["hvd.spark_app_id"] == spark_local.sparkContext.applicationId
    assert run.data.params["on_spark"] == "True" and run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == sorted(runner.metrics["loss"]) and len(history) == 300
    assert sum(batches) == 300 and len(batches) <= 4, batches  # one call every few seconds, not one per step


def failing_training():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        raise ValueError("the data is gone\nsecond line")
    dist.barrier()


def test_a_failed_run_ends_its_mlflow_run_failed_with_the_cause(mlflow_server):
    name = experiment()
    runner = TorchDistributor(2, use_gpu=False, mlflow={"tracking_uri": mlflow_server, "experiment_name": name})
    with pytest.raises(RankFailedError, match="the data is gone"):
        runner.run(failing_training)
    (run,) = runs_of(MlflowClient(mlflow_server), name)
    assert run.info.run_id == runner.mlflow_run_id
    assert run.info.status == "FAILED"
    assert "the data is gone" in run.data.tags["hvd.failure"] and "second line" not in run.data.tags["hvd.failure"]
    assert run.data.tags["hvd.runner"] == "TorchDistributor" and run.data.params["num_processes"] == "2"


class OnCheckpoint(logging.Handler):
    """Calls ``action`` once the driver has the rank's checkpoint (its metrics came before it)."""

    def __init__(self, action) -> None:
        super().__init__()
        self.action = action

    def emit(self, record: logging.LogRecord) -> None:
        if "reported the checkpoint" in record.getMessage():
            self.action()


class OnMessage(logging.Handler):
    def __init__(self, text: str, action) -> None:
        super().__init__()
        self.text, self.action = text, action

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.action()


def training_until_cancelled():
    import time

    from airflow_provider_hvd.runner import log_metrics, report_checkpoint

    log_metrics(1, loss=0.25)
    report_checkpoint("/ckpt/1.pt")
    time.sleep(300)


def test_a_cancelled_run_ends_its_mlflow_run_killed_with_what_was_reported(mlflow_server, runner_log):
    name = experiment()
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": mlflow_server, "experiment_name": name})
    runner_log(OnCheckpoint(runner.cancel))
    with pytest.raises(RunCancelledError):
        runner.run(training_until_cancelled)
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, name)
    assert run.info.status == "KILLED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.25)]
    assert run.data.tags["hvd.checkpoint.path"] == "/ckpt/1.pt"


def test_a_cancel_before_the_ranks_start_leaves_no_mlflow_run_running(mlflow_server, runner_log):
    name = experiment()
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": mlflow_server, "experiment_name": name})
    runner_log(CancelAtLaunch(runner))
    with pytest.raises(RunCancelledError):
        runner.run(training_until_cancelled)
    (run,) = runs_of(MlflowClient(mlflow_server), name)
    assert run.info.status == "KILLED"


class Interrupted(BaseException):
    """What a signal raises in the driver (Airflow's task timeout, a SIGTERM's handler)."""


def interrupt(*_args) -> None:
    raise Interrupted


@pytest.mark.parametrize("moment", ["as the MLflow run is created", "before the supervisor starts"])
def test_an_interrupt_before_the_ranks_start_ends_the_mlflow_run_killed_and_its_writer(
    moment, mlflow_server, runner_log
):
    name = experiment()
    settings = MlflowSettings(tracking_uri=mlflow_server, experiment_name=name)
    if moment == "as the MLflow run is created":
        settings.on_start = interrupt
    else:
        runner_log(OnMessage("resuming from", interrupt))  # logged once the run exists, before the ranks start
    runner = HorovodRunner(np=-2, mlflow=settings, resume_from="/ckpt/1.pt")
    with pytest.raises(Interrupted):
        runner.run(returns_seven)
    (run,) = runs_of(MlflowClient(mlflow_server), name)
    assert run.info.status == "KILLED"
    assert not [thread for thread in threading.enumerate() if thread.name == "hvd-mlflow-writer"]


def returns_seven():
    return 7


def test_a_retry_links_the_previous_tries_run_and_ends_it_killed_when_left_running(mlflow_server):
    client, name = MlflowClient(mlflow_server), experiment()
    previous = client.create_run(client.create_experiment(name))  # a try that died without ending its run
    settings = MlflowSettings(tracking_uri=mlflow_server, experiment_name=name, previous_run_id=previous.info.run_id)
    runner = HorovodRunner(np=-2, mlflow=settings)
    assert runner.run(returns_seven) == 7
    new = client.get_run(runner.mlflow_run_id)
    assert new.data.tags["hvd.previous_run_id"] == previous.info.run_id and new.info.status == "FINISHED"
    old = client.get_run(previous.info.run_id)
    assert old.info.status == "KILLED" and runner.mlflow_run_id in old.data.tags["hvd.ended_by"]


@pytest.fixture
def silent_server():
    """A port that takes connections and never answers (a hung tracking server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("server", ["down", "hung", "not MLflow", "unknown scheme", "unwritable store"])
def test_a_tracking_server_that_fails_costs_one_warning_and_not_the_run(
    server, mlflow_server, silent_server, monkeypatch, caplog
):
    from spark_cluster import free_port

    monkeypatch.setattr(mlflow_run, "START_WAIT_S", 2.0)  # (10 s in production)
    uri = {
        "down": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "hung": silent_server,
        "not MLflow": f"{mlflow_server}/no/such/api",  # answers 404
        "unknown scheme": "bogus-scheme://x",  # MLflow's client refuses it as it is made
        "unwritable store": "sqlite:////proc/no-such-dir/mlflow.db",
    }[server]
    caplog.set_level(logging.INFO, RUNNER_LOG)
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": uri})
    began = time.monotonic()
    assert runner.run(returns_seven) == 7
    took = time.monotonic() - began
    assert runner.mlflow_run_id is None and runner.mlflow_run_url is None
    (warning,) = mlflow_warnings(caplog)
    assert uri in warning and "goes on without MLflow" in warning
    assert took < 45, f"the run took {took:.0f}s"  # MLflow's own retries would take minutes


class HangingProxy(RecordingProxy):
    """Forwards to the tracking server until ``hung`` is set; from then on nothing passes (a hung server) until
    :meth:`release`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.hung, self._go, self._closing = threading.Event(), threading.Event(), threading.Event()
        super().__init__(target)

    def release(self) -> None:
        self.hung.clear()
        self._go.set()

    def _forwarders(self, client: socket.socket, server: socket.socket) -> list:
        return [(self._forward, (client, server)), (self._forward, (server, client))]

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if self.hung.is_set():
                    self._go.wait()  # held: the other side waits for an answer
                    if self._closing.is_set():
                        break
                dst.sendall(data)
        except OSError:
            pass
        self.reset(src, dst)

    def close(self) -> None:
        self._closing.set()
        self._go.set()
        self.reset(self.listener, *self._socks)  # (a shutdown wakes the accept() in progress; a close does not)
        super().close()


def reports_and_returns():
    from airflow_provider_hvd.runner import log_metrics, report_checkpoint

    log_metrics(1, loss=0.5)
    report_checkpoint("/ckpt/1.pt")
    return 7


@pytest.mark.parametrize("trouble", ["hangs at the end", "deleted the run"])
def test_a_tracking_server_that_fails_later_costs_one_warning_and_at_most_final_write_s(
    trouble, mlflow_server, caplog, runner_log
):
    client, name = MlflowClient(mlflow_server), experiment()
    proxy = HangingProxy(("127.0.0.1", urllib.parse.urlsplit(mlflow_server).port))
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": f"http://127.0.0.1:{proxy.port}", "experiment_name": name})
    if trouble == "hangs at the end":
        action = proxy.hung.set
    else:
        action = lambda: client.delete_run(runner.mlflow_run_id)  # noqa: E731 - its next writes are refused
    runner_log(OnCheckpoint(action))
    caplog.set_level(logging.INFO, RUNNER_LOG)
    began = time.monotonic()
    try:
        assert runner.run(reports_and_returns) == 7
    finally:
        took = time.monotonic() - began
        proxy.close()
    (warning,) = mlflow_warnings(caplog)
    assert runner.mlflow_run_id in warning
    if trouble == "hangs at the end":
        assert f"did not answer within {FINAL_WRITE_S:g}s of the run's end" in warning
        assert took < 60, f"the run took {took:.0f}s"  # MLflow's own request timeout is 120 s
    else:
        assert "could not log the metrics" in warning


def test_an_mlflow_run_created_after_the_start_gave_up_is_ended_killed(mlflow_server, monkeypatch, caplog, runner_log):
    monkeypatch.setattr(mlflow_run, "START_WAIT_S", 1.0)
    client, name = MlflowClient(mlflow_server), experiment()
    proxy = HangingProxy(("127.0.0.1", urllib.parse.urlsplit(mlflow_server).port))
    proxy.hung.set()  # the server answers once the run's start gave up on it
    runner_log(OnMessage("did not create the run within", proxy.release))
    try:
        runner = HorovodRunner(
            np=-2, mlflow={"tracking_uri": f"http://127.0.0.1:{proxy.port}", "experiment_name": name}
        )
        assert runner.run(returns_seven) == 7 and runner.mlflow_run_id is None
        deadline = time.monotonic() + 60
        while not [run for run in runs_of(client, name) if run.info.status == "KILLED"]:  # the writer's last call
            assert time.monotonic() < deadline, [run.info for run in runs_of(client, name)]
            time.sleep(0.2)
    finally:
        proxy.close()
    (run,) = runs_of(client, name)
    assert "gave up on it" in run.data.tags["hvd.failure"]
    assert len(mlflow_warnings(caplog)) == 1


def autologged_training():
    import os

    if int(os.environ["HOROVOD_RANK"]) != 0:
        return None
    import keras
    import mlflow
    import numpy as np

    mlflow.autolog(log_models=False, log_datasets=False, silent=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.random.rand(32, 4), np.random.rand(32, 1), epochs=2, verbose=0)
    return None


def test_mlflow_autolog_in_rank_0_logs_into_the_runners_run(mlflow_server):
    name = experiment()
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": mlflow_server, "experiment_name": name})
    runner.run(autologged_training)
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, name)
    assert run.info.run_id == runner.mlflow_run_id and run.info.status == "FINISHED"
    assert run.data.tags.get("mlflow.autologging") == "keras" and run.data.params["epochs"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]  # one per epoch


def test_metrics_waiting_for_a_server_that_takes_none_stay_bounded(monkeypatch, caplog):
    monkeypatch.setattr(mlflow_run, "_MAX_DUE", 5)
    run = mlflow_run.MlflowRun(MlflowSettings(), "HorovodRunner", 2, {})
    run.run_id = "r1"  # (created; its writer is stuck in the tracking server)
    for step in range(4):
        run.take(0, Metrics(step, {"loss": 1.0, "acc": None, "bad name?": 2.0}, time.time()))
    run.take(1, Metrics(9, {"loss": 1.0}, time.time()))  # not the metrics rank
    assert [(m.key, m.step) for m in run._metrics] == [("loss", 0), ("acc", 0), ("loss", 1), ("acc", 1), ("loss", 2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "'bad name?' is not an MLflow metric name" in warnings[0]
    assert "5 metric points wait" in warnings[1]


def test_a_metric_value_that_is_no_number_is_left_out_with_a_warning_and_the_others_kept(caplog):
    run = mlflow_run.MlflowRun(MlflowSettings(), "HorovodRunner", 2, {})
    run.run_id = "r1"  # (created)
    for step in range(2):  # (a rank's log_metrics sends floats only: this is a message from elsewhere)
        run.take(0, Metrics(step, {"loss": 0.5, "note": "high", "acc": 0.75}, time.time()))
    assert [(m.key, m.step, m.value) for m in run._metrics] == [
        ("loss", 0, 0.5),
        ("acc", 0, 0.75),
        ("loss", 1, 0.5),
        ("acc", 1, 0.75),
    ]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "'note'" in warning and "'high'" in warning


def test_the_mlflow_setting_is_checked_and_mlflow_must_be_installed(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['experiment'\]; the known ones are \['tracking_uri'"):
        mlflow_settings({"experiment": "x"})
    assert mlflow_settings(False) is None and mlflow_settings(True) == MlflowSettings()
    assert mlflow_settings({"tags": {"a": 1}}) == MlflowSettings(tags={"a": "1"})
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if MLflow's client were not installed
    with pytest.raises(ImportError, match=r"pip install 'airflow-provider-hvd\[mlflow\]'"):
        HorovodRunner(np=-2, mlflow=True)
    HorovodRunner(np=-2)  # without mlflow, MLflow is not needed


# -- credentials: a tracking server that wants them, and none of them in a log line or a link -------------------

#: what MLflow's client authenticates with besides the tracking URI (mlflow.utils.credentials reads them)
AUTH_SETTINGS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
)


def logs_a_metric_as_rank_0(names=()):
    import os

    if int(os.environ["HOROVOD_RANK"]) != 0:
        return None
    import mlflow

    mlflow.log_metric("rank0_loss", 0.5, step=1)  # rank 0's own call, to a server that wants a password
    return {name: os.environ.get(name) for name in names}


def executor_env(spark, name: str):
    import os

    return spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ.get(name)).collect()[0]


def test_rank_0_on_spark_logs_into_a_tracking_server_that_wants_a_password(
    spark_local, mlflow_auth_server, monkeypatch, caplog, capsys
):
    """Before: rank 0 on an executor got the run's id and URI, not the driver's credentials: its
    ``mlflow.log_metric`` got 401 and the training failed (np<0 worked: its ranks inherit the driver's
    environment)."""
    server = mlflow_auth_server
    # in the driver's environment only: the executors' JVM started before, without them
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")  # (a TLS setting: an http server has no TLS)
    assert executor_env(spark_local, "MLFLOW_TRACKING_PASSWORD") is None
    caplog.set_level(logging.DEBUG)
    name = experiment()
    runner = HorovodRunner(np=2, mlflow={"tracking_uri": server.url, "experiment_name": name})
    seen = runner.run(logs_a_metric_as_rank_0, names=["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_INSECURE_TLS"])
    assert seen == {"MLFLOW_TRACKING_USERNAME": server.username, "MLFLOW_TRACKING_INSECURE_TLS": "true"}
    client = MlflowClient(server.url)  # (with the credentials of the environment)
    run = client.get_run(runner.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rank0_loss")] == [(1, 0.5)]
    assert server.password not in caplog.text + "".join(capsys.readouterr())


def test_credentials_in_the_tracking_uri_are_in_no_log_line_and_no_link(mlflow_auth_server, caplog, monkeypatch):
    """Before: the "MLflow run ... at <url>" line and ``mlflow_run_url`` (the operator's link, the Training tab)
    held the URI's ``user:password@``."""
    server, name, started = mlflow_auth_server, experiment(), []
    for setting in AUTH_SETTINGS:
        monkeypatch.delenv(setting, raising=False)
    uri = server.url.replace("://", f"://{server.username}:{server.password}@")
    caplog.set_level(logging.DEBUG)
    settings = MlflowSettings(tracking_uri=uri, experiment_name=name, on_start=lambda *run: started.append(run))
    runner = HorovodRunner(np=-2, mlflow=settings)
    assert runner.run(logs_a_metric_as_rank_0) == {}  # rank 0 logged with the URI's credentials
    (run,) = runs_of(MlflowClient(uri), name)
    assert run.info.status == "FINISHED" and run.data.metrics["rank0_loss"] == 0.5
    assert runner.mlflow_run_url == f"{server.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert started == [(run.info.run_id, runner.mlflow_run_url)]
    assert runner.mlflow_run_url in caplog.text and server.password not in caplog.text


def test_a_database_password_in_the_tracking_uri_is_not_logged(caplog):
    """Before: ``could not create the MLflow run in postgresql://hvd:<password>@...`` at WARNING."""
    uri = "postgresql://hvd:s3cr3t-pw@127.0.0.1:1/mlflow"
    caplog.set_level(logging.DEBUG)
    runner = HorovodRunner(np=-2, mlflow={"tracking_uri": uri})
    assert runner.run(returns_seven) == 7 and runner.mlflow_run_id is None
    (warning,) = mlflow_warnings(caplog)
    assert "postgresql://hvd:***@127.0.0.1:1/mlflow" in warning and "goes on without MLflow" in warning
    assert "s3cr3t-pw" not in caplog.text


def test_rank_0_gets_every_setting_mlflow_authenticates_with(monkeypatch, tmp_path):
    """What MLflow's client of the driver authenticates with (its environment, ``~/.mlflow/credentials``), rank 0
    gets in its environment: MLflow there resolves the same credentials."""
    from mlflow.environment_variables import _EnvironmentVariable
    from mlflow.utils import credentials
    from mlflow.utils.credentials import get_default_host_creds

    read = {value.name for value in vars(credentials).values() if isinstance(value, _EnvironmentVariable)}
    assert read == set(AUTH_SETTINGS)  # an MLflow that reads one more fails here: rank 0 needs it too
    home = tmp_path / "home"
    (home / ".mlflow").mkdir(parents=True)
    (home / ".mlflow" / "credentials").write_text(
        "[mlflow]\nmlflow_tracking_username = u\nmlflow_tracking_password = p4ss\n"
    )
    monkeypatch.setenv("HOME", str(home))
    for setting in AUTH_SETTINGS:
        monkeypatch.delenv(setting, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t0ken")
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "my_auth_plugin")
    monkeypatch.setenv("MLFLOW_TRACKING_AWS_SIGV4", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", "/etc/ssl/mlflow-ca.pem")
    monkeypatch.setenv("MLFLOW_TRACKING_CLIENT_CERT_PATH", "/etc/ssl/mlflow-client.pem")
    driver = vars(get_default_host_creds("https://mlflow:5000"))
    run = mlflow_run.MlflowRun(MlflowSettings(), "HorovodRunner", 2, {})
    run.run_id, run.tracking_uri, run.experiment_id = "r1", "https://mlflow:5000", "0"  # (created)
    env = run.rank_env(0)
    assert run.rank_env(1) == {}
    monkeypatch.setenv("HOME", str(tmp_path))  # rank 0's host: no credentials file, only what it was given
    for setting in AUTH_SETTINGS:
        monkeypatch.delenv(setting, raising=False)
    for setting, value in env.items():
        monkeypatch.setenv(setting, value)
    assert vars(get_default_host_creds(env["MLFLOW_TRACKING_URI"])) == driver
    assert driver["username"] == "u" and driver["password"] == "p4ss" and driver["token"] == "t0ken"
