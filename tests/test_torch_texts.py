"""A TorchDistributor run speaks of TorchDistributor and its own parameters (``num_processes``,
``local_mode=True``): each of its refusals and failures, and every line it logs, has no word of Horovod.

The Spark settings keep their names (``spark.horovodRunner.*``, lower-case: the package's settings for both
runners). HorovodRunner's own texts are checked where its runs are tested.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import threading

import pytest
import torch_jobs
from cancels import CancelAtLaunch
from conftest import make_session
from spark_cluster import free_port

from airflow_provider_hvd import LaunchError, RankFailedError, RunCancelledError, RunStalledError, TorchDistributor
from airflow_provider_hvd.runner.driver.launch.address import RENDEZVOUS_PORT_CONF
from airflow_provider_hvd.runner.driver.launch.spark.capacity import busy_slots

RUNNER_LOG = "airflow_provider_hvd.runner"


@pytest.fixture(scope="module")
def store_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def spark_fixed_store(store_port):
    """local[2], the torch.distributed store on a fixed port (``spark.horovodRunner.rendezvousPort``)."""
    spark = make_session("local[2]", **{RENDEZVOUS_PORT_CONF: str(store_port)})
    yield spark
    spark.stop()


@pytest.fixture(autouse=True)
def every_line(spark_fixed_store, caplog):
    caplog.set_level(logging.DEBUG, logger="airflow_provider_hvd")


def no_horovod(caplog, *texts: str) -> None:
    """Neither ``texts`` (the run's error) nor any line the package logged in the test names Horovod."""
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("airflow_provider_hvd")]
    horovod = [text for text in [*texts, *logged] if "Horovod" in text]
    assert not horovod, "\n---\n".join(horovod)


def failure(runner: TorchDistributor, job, *args, error=Exception) -> str:
    with pytest.raises(error) as caught:
        runner.run(job, *args)
    return str(caught.value)


def test_too_many_processes_for_the_cluster(caplog):
    text = failure(TorchDistributor(3, local_mode=False, use_gpu=False), torch_jobs.print_a_line, error=LaunchError)
    no_horovod(caplog, text)
    assert text.startswith("TorchDistributor(num_processes=3) needs 3 Spark task slots at once"), text
    assert "Lower num_processes to at most 2" in text and "or use local_mode=True to run on this host" in text, text


def test_a_busy_application(caplog, spark_fixed_store):
    sc = spark_fixed_store.sparkContext
    holding = threading.Event()

    def hold_a_slot() -> None:
        sc.setJobGroup("hold-a-slot", "holds one of local[2]'s slots", interruptOnCancel=True)
        try:
            sc.parallelize([0], 1).foreach(lambda _: __import__("time").sleep(120))
        except Exception:  # noqa: BLE001 - cancelled below
            pass
        finally:
            holding.set()

    holder = threading.Thread(target=hold_a_slot)
    holder.start()
    try:
        while busy_slots(sc) < 1 and not holding.is_set():
            holding.wait(0.2)
        runner = TorchDistributor(2, local_mode=False, use_gpu=False, slot_wait_timeout=1)
        text = failure(runner, torch_jobs.print_a_line, error=LaunchError)
    finally:
        sc.cancelJobGroup("hold-a-slot")
        holder.join()
    no_horovod(caplog, text)
    assert text.startswith("TorchDistributor(num_processes=2) waited "), text
    assert text.endswith("or lower num_processes."), text


def test_the_stores_port_taken(caplog, store_port):
    with socket.create_server(("127.0.0.1", store_port)):
        text = failure(TorchDistributor(2, False, False), torch_jobs.print_a_line, error=LaunchError)
    no_horovod(caplog, text)
    assert text.startswith(f"TorchDistributor cannot listen for its torch.distributed store on 127.0.0.1:{store_port}")
    assert "by another TorchDistributor run (a fixed port serves one run at a time)" in text, text


def test_a_failing_process(caplog):
    runner = TorchDistributor(2, False, False)
    text = failure(runner, torch_jobs.fail_inside_collective, "rank 1 broke", error=RankFailedError)
    no_horovod(caplog, text)
    assert text.startswith("torch.distributed rank 1 of 2 failed: ValueError: rank 1 broke"), text


def test_a_process_killed_from_outside(caplog):
    runner = TorchDistributor(2, False, False)
    text = failure(runner, torch_jobs.kill_myself, 0, int(signal.SIGTERM), error=RankFailedError)
    no_horovod(caplog, text)
    assert "SIGTERM came from outside TorchDistributor" in text, text


def test_a_cancelled_run(caplog):
    runner = TorchDistributor(2, False, False)
    handler, logger = CancelAtLaunch(runner, when="ranks started"), logging.getLogger(RUNNER_LOG)
    logger.addHandler(handler)
    try:
        text = failure(runner, torch_jobs.hang_in_a_collective, error=RunCancelledError)
    finally:
        logger.removeHandler(handler)
    no_horovod(caplog, text)
    assert text == "TorchDistributor: the run was cancelled; every rank was ended", text


def test_a_stalled_run(caplog):
    runner = TorchDistributor(2, False, False, stall_timeout=3)
    text = failure(runner, torch_jobs.hang_in_a_collective, error=RunStalledError)
    no_horovod(caplog, text)
    assert text.startswith("TorchDistributor: the run stalled"), text


def test_processes_that_never_start(caplog):
    # the driver takes one agent's hello at a time: never both before the deadline
    runner = TorchDistributor(2, False, False, start_timeout=0.001)
    text = failure(runner, torch_jobs.print_a_line, error=LaunchError)
    no_horovod(caplog, text)
    assert re.match(r"only [01] of 2 ranks had started after 0s \(a Spark barrier job of 2 tasks on local\[2\]\)", text)


def test_a_slow_exit(caplog):
    assert TorchDistributor(2, False, False, exit_timeout=1).run(torch_jobs.slow_to_exit, 1) == 0
    no_horovod(caplog)
    warned = [r.getMessage() for r in caplog.records if "was still exiting" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("TorchDistributor: rank 1 "), warned


def test_the_gpu_refusals_of_the_constructor(caplog):
    with pytest.raises(RuntimeError) as local:
        TorchDistributor(2, local_mode=True, use_gpu=True)
    with pytest.raises(RuntimeError) as on_spark:
        TorchDistributor(2, local_mode=False, use_gpu=True)
    no_horovod(caplog, str(local.value), str(on_spark.value))
    assert str(local.value).startswith("GPUs were unable to be found on the driver. TorchDistributor("), local.value
    assert str(on_spark.value).startswith("'spark.task.resource.gpu.amount' was unset, so gpu usage is unavailable.")
