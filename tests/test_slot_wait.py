"""A busy cluster is waited for, within a bound; a job that can never fit is refused at once (as sparkdl)."""

from __future__ import annotations

import logging
import select
import subprocess
import sys
import threading
import time

import pytest
from conftest import make_session
from jobs import allreduce_sum

from airflow_provider_hvd import HorovodRunner, LaunchError, RunCancelledError
from airflow_provider_hvd.runner.driver.launch.spark import capacity, cluster

# Another Spark application that takes both cores of the cluster until its stdin closes.
HOLDER = """
import sys, time
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master(sys.argv[1]).appName("slot-holder").config("spark.ui.enabled", "false")
         .config("spark.cores.max", "2").config("spark.executor.cores", "1").getOrCreate())
jsc = spark.sparkContext._jsc.sc()
while jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()) < 2:
    time.sleep(0.2)
print("holding", flush=True)
sys.stdin.read()
spark.stop()
"""


@pytest.fixture(scope="module")
def holder(standalone_cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("holder") / "holder.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, standalone_cluster.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "holding", f"the holder did not start: {log.read_text()}"
        yield proc
    finally:
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def busy_session(standalone_cluster, holder):
    """An application on the cluster while the holder has every core: it has no executor yet."""
    spark = make_session(
        standalone_cluster.url, **{"spark.executor.cores": "1", "spark.cores.max": "2", **standalone_cluster.app_conf}
    )
    yield spark
    spark.stop()


@pytest.fixture
def quick_reports(monkeypatch, caplog):
    monkeypatch.setattr(capacity, "REPORT_EVERY_S", 1.0)
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    return caplog


def waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]


@pytest.mark.parametrize(
    ("conf", "slots_at_most"),
    [
        ({}, 4),  # one executor per worker, all its cores
        ({"spark.cores.max": "3"}, 3),
        ({"spark.task.cpus": "2"}, 1),  # 3 // 2 + 1 // 2: a task needs its 2 cores on one worker
        ({"spark.executor.cores": "2"}, 2),  # one 2-core executor, on the 3-core worker
        ({"spark.executor.memory": "3g"}, 0),  # no worker has 3 GiB
        ({"spark.executor.cores": "1", "spark.executor.memory": "1g", "spark.cores.max": "2"}, 2),
    ],
)
def test_standalone_capacity(conf, slots_at_most):
    state = {
        "workers": [
            {"state": "ALIVE", "cores": 3, "memory": 2048},
            {"state": "ALIVE", "cores": 1, "memory": 2048},
            {"state": "DEAD", "cores": 8, "memory": 65536},
        ]
    }
    assert capacity.standalone_capacity(state, conf) == slots_at_most


def test_master_urls():
    assert cluster.standalone_masters("spark://a:7077,b:7078") == [("a", 7077), ("b", 7078)]
    assert cluster.standalone_masters("spark://[::1]:7077") == [("::1", 7077)]
    assert cluster.standalone_masters("local[2]") == []
    for bad in ("spark://127.0.0.1", "spark://h:7077:7077"):  # no port; a port in the host and the Port field
        with pytest.raises(ValueError, match="needs a host and a port"):
            cluster.standalone_masters(bad)


@pytest.mark.parametrize("bad", [-1, "600", float("nan"), True])
def test_the_bound_is_checked(bad):
    with pytest.raises(ValueError, match="slot_wait_timeout must be a number of seconds >= 0"):
        HorovodRunner(np=2, slot_wait_timeout=bad)


def test_a_job_that_can_never_fit_is_refused_at_once(busy_session):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* has 2 at most"):
        HorovodRunner(np=3, slot_wait_timeout=600).run(allreduce_sum)
    assert time.monotonic() - started < 30  # not the 600 s bound


def test_a_busy_cluster_is_waited_for_up_to_the_bound(busy_session, quick_reports):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"waited 3s for 2 free Spark task slots .* has 0 .*slot_wait_timeout"):
        HorovodRunner(np=2, slot_wait_timeout=3).run(allreduce_sum)
    assert 3 <= time.monotonic() - started < 30
    assert len(waits(quick_reports)) >= 2  # reported as it waits (every 30 s; every 1 s here)
    assert "the application has 0 of the 2 it could hold" in waits(quick_reports)[0]


def test_a_wait_ends_when_the_run_is_cancelled(busy_session):
    runner = HorovodRunner(np=2)
    threading.Timer(1.0, runner.cancel).start()
    started = time.monotonic()
    with pytest.raises(RunCancelledError, match="while waiting for 2 task slots"):
        runner.run(allreduce_sum)
    assert time.monotonic() - started < 15


def test_the_job_runs_once_the_other_application_leaves(busy_session, holder, quick_reports):
    threading.Timer(3.0, holder.stdin.close).start()  # the other application ends in 3 s
    result = HorovodRunner(np=2).run(allreduce_sum)
    assert result["size"] == 2 and result["sum"] == 3.0
    assert waits(quick_reports), "the run did not report its wait"


def hold_a_slot(started_dir: str, held: str):
    """A Spark task that holds its slot while the file ``held`` exists (another job of the same application)."""

    def task(partition):
        import os
        import time

        index = next(iter(partition), None)
        open(os.path.join(started_dir, f"task-{index}"), "w").close()
        while os.path.exists(held):
            time.sleep(0.1)
        return []

    return task


class _ReleaseOnWait(logging.Handler):
    """Removes ``held`` at the runner's first report of its wait (what the test waits for, not a time)."""

    def __init__(self, held) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for" in record.getMessage():
            self.held.unlink(missing_ok=True)


def test_slots_held_by_the_applications_own_jobs_are_waited_for(busy_session, holder, quick_reports, tmp_path):
    """Before: the wait counted the slots that exist (2), returned at once, and the run failed after the start
    timeout (LaunchError "only 0 of 2 ranks had started after 120s") while another job of the same application
    held both slots; the wait never said what it waited for."""
    holder.stdin.close()  # the other application leaves, if an earlier test has not made it leave
    sc = busy_session.sparkContext
    deadline = time.monotonic() + 120
    while capacity.slots_now(sc) < 2 and time.monotonic() < deadline:  # its executors come as the holder leaves
        time.sleep(0.2)
    assert capacity.slots_now(sc) == 2
    held, started = tmp_path / "held", tmp_path / "started"
    held.touch()
    started.mkdir()
    job = threading.Thread(
        target=lambda: sc.parallelize(range(2), 2).mapPartitions(hold_a_slot(str(started), str(held))).collect()
    )
    job.start()
    tracker = sc.statusTracker()

    def running() -> int:
        return sum(info.numActiveTasks for s in tracker.getActiveStageIds() if (info := tracker.getStageInfo(s)))

    while (len(list(started.iterdir())) < 2 or running() < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == 2, "the other job did not take both slots"
    release = _ReleaseOnWait(held)
    logger = logging.getLogger("airflow_provider_hvd.runner")
    logger.addHandler(release)
    try:
        runner = HorovodRunner(np=2, start_timeout=60)  # (before, the run failed after it: not the whole 120 s)
        result = runner.run(allreduce_sum)
    finally:
        logger.removeHandler(release)
        held.unlink(missing_ok=True)
        job.join(60)
    assert result["size"] == 2 and result["sum"] == 3.0
    assert waits(quick_reports), "the run did not wait for the slots the other job held"
    assert "the application has 2 of the 2 it could hold, 2 of them busy with its other jobs" in waits(quick_reports)[0]


def test_a_wait_on_a_master_whose_ui_does_not_answer_says_the_total_is_unknown_and_names_the_setting(
    busy_session, quick_reports
):
    """Before: "the application has 0 (2s waited, up to 2s)", never saying why a job that cannot fit waits."""
    conf = busy_session.sparkContext._conf  # the running SparkContext's own settings
    right = conf.get(cluster.MASTER_WEB_UI_CONF)
    conf.set(cluster.MASTER_WEB_UI_CONF, "http://127.0.0.1:9")  # as a wrong URL would: nothing answers there
    try:
        with pytest.raises(
            LaunchError,
            match=r"the cluster's total is unknown \(http://127.0.0.1:9/json/ did not "
            r"answer.*set spark.horovodRunner.masterWebUiUrl",
        ):
            HorovodRunner(np=3, slot_wait_timeout=2).run(allreduce_sum)
    finally:
        conf.set(cluster.MASTER_WEB_UI_CONF, right)
    assert "the cluster's total is unknown" in waits(quick_reports)[0]
    assert "spark.horovodRunner.masterWebUiUrl" in waits(quick_reports)[0]


def test_cores_and_gpus_that_limit_equally_are_both_named():
    """Before: the refusal named only spark.task.cpus."""
    gpu_worker = {"state": "ALIVE", "cores": 1, "memory": 2048, "resources": {"gpu": {"addresses": ["0"]}}}
    conf = {"spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "1"}
    message = str(capacity.never_fits_error("spark://m:7077", 3, 2, conf, {"workers": [gpu_worker, gpu_worker]}))
    assert "has 2 at most (spark.task.cpus=1). Cores and GPUs both limit it" in message
    assert "spark.task.resource.gpu.amount=1 (2 on the workers)" in message
    gpus_only = str(
        capacity.never_fits_error("spark://m:7077", 3, 2, conf, {"workers": [{**gpu_worker, "cores": 4}] * 2})
    )
    assert "GPUs are what limits it (2 on the workers)" in gpus_only and "Cores and GPUs" not in gpus_only


def test_a_submitted_runs_cpu_only_host_is_a_core_beside_the_gpu_slots_and_its_refusal_a_host_slot_error(
    monkeypatch,
):
    """Two workers of 2 GPUs and 2 cores, tasks of one GPU: 4 ranks take every GPU slot. The run's host, a task of
    one CPU, needs a core beside them: with 3 cores a worker it fits; with 2 only the host does not, and the
    refusal is the HostSlotError the operators run in-process on, naming the core (not a slot) and the np that
    fits."""
    from airflow_provider_hvd import HostSlotError

    gpus = {"gpu": {"addresses": ["0", "1"]}}
    conf = {"spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "2"}
    count = capacity.SlotCount("spark://m:7077", conf.get, "on spark://m:7077")
    count.beside = capacity.CpuTasks(pending=1)
    for cores in (3, 2):
        worker = {"state": "ALIVE", "cores": cores, "memory": 2048, "resources": gpus}
        monkeypatch.setattr(count, "_state", lambda worker=worker: {"workers": [worker, worker]})
        if cores == 3:
            count.fits(4, count.at_most())
            continue
        with pytest.raises(HostSlotError) as caught:
            count.fits(4, count.at_most())
    assert "4 ranks fit the cluster at spark://m:7077 (4 Spark task slots at most)" in str(caught.value)
    assert "needs 1 core beside them" in caught.value.reason
    assert "Give the cluster one more core, lower np to at most 3, or use run()" in str(caught.value)


def test_a_run_and_its_ui_link_fetch_the_masters_state_once(busy_session, monkeypatch):
    """Before: the UI link, the most slots and the refusal's GPU note each fetched the master's /json/."""
    from airflow_provider_hvd.hooks.spark_ui import application_ui_url

    fetches = []
    fetch = cluster._fetch_master_state
    monkeypatch.setattr(cluster, "_fetch_master_state", lambda *args: fetches.append(args) or fetch(*args))
    monkeypatch.setattr(cluster, "_fetched", {})  # nothing kept from earlier tests
    assert application_ui_url(busy_session.sparkContext)  # what the hook does before the run
    with pytest.raises(LaunchError, match=r"needs 3 Spark task slots .* has 2 at most"):
        HorovodRunner(np=3).run(allreduce_sum)
    assert len(fetches) == 1
