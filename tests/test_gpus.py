"""GPU clusters without a GPU: Spark schedules made-up GPUs exactly like real ones, and ranks see theirs.

A real GPU run is `scripts/gpu_check.sh` (it needs a GPU machine).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from conftest import make_session
from spark_cluster import StandaloneCluster

from airflow_provider_hvd import HorovodRunner, LaunchError
from airflow_provider_hvd.runner.driver.ranks.plan import gpus_by_node, plan_by_node
from airflow_provider_hvd.runner.shared.gpus import host_gpus, visible_gpus


@pytest.mark.parametrize(
    ("own", "seen"),
    [
        ([["0"], ["1"]], [["0", "1"], ["0", "1"]]),  # one each: all of the host's, in local-rank order
        ([["3"], ["1"], ["2"]], [["3", "1", "2"]] * 3),
        ([["0", "1"], ["2", "3"]], [["0", "1"], ["2", "3"]]),  # several each: its own only
        ([["0"], ["0"]], [["0"], ["0"]]),  # shared (a fractional amount per task): its own only
        ([[], []], [None, None]),  # none asked for: nothing changes
    ],
)
def test_what_each_rank_sees(own, seen):
    assert visible_gpus(own) == seen


@pytest.mark.parametrize(
    "hosts", [["a", "a"], ["a", "b", "a", "c", "b"], ["a", "b", "b", "b"], ["x"] * 5 + ["y"], ["a", "b", "c"]]
)
def test_horovods_ranks_are_planned_as_horovod_assigns_hosts(hosts):
    """Contiguous by host, in agent order; the cross rank and size per local rank, as Horovod's own assignment."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    per_host = {host: hosts.count(host) for host in dict.fromkeys(hosts)}
    horovods = get_host_assignments([HostInfo(host, slots) for host, slots in per_host.items()], len(hosts))
    in_rank_order = sorted(range(len(hosts)), key=lambda agent: list(per_host).index(hosts[agent]))
    expected = [vars(slot) for _, slot in sorted(zip(in_rank_order, horovods, strict=True))]
    assert [vars(slot) for slot in plan_by_node(hosts, cross="local_rank")] == expected


def test_torchs_ranks_are_planned_by_node_and_each_sees_the_gpus_of_its_node():
    plan = plan_by_node(["task 0", "task 1", "task 0", "task 1"])
    assert [(s.rank, s.local_rank, s.cross_rank, s.local_size, s.cross_size) for s in plan] == [
        (0, 0, 0, 2, 2),
        (2, 0, 1, 2, 2),
        (1, 1, 0, 2, 2),
        (3, 1, 1, 2, 2),
    ]
    assert gpus_by_node(plan, [["0"], ["2"], ["1"], ["3"]]) == [["0", "1"], ["2", "3"], ["0", "1"], ["2", "3"]]


def fake_nvidia_smi(directory: Path, gpus: int) -> str:
    script = directory / "nvidia-smi"
    lines = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d}-fake)" for i in range(gpus))
    script.write_text(f'#!/bin/sh\n[ "$1" = "-L" ] && printf "{lines}\\n"\n')
    script.chmod(0o755)
    return str(directory)


def test_the_hosts_gpus(tmp_path):
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == (["3", "5"], "CUDA_VISIBLE_DEVICES='3,5'")
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == []
    assert host_gpus({"PATH": fake_nvidia_smi(tmp_path, 4)}) == (["0", "1", "2", "3"], "nvidia-smi -L")
    assert host_gpus({"PATH": str(tmp_path / "nothing-here")})[0] == []


def cuda_view() -> dict:
    import horovod.torch as hvd

    hvd.init()
    return {
        "visible": hvd.allgather_object(os.environ.get("CUDA_VISIBLE_DEVICES")),
        "order": hvd.allgather_object(os.environ.get("CUDA_DEVICE_ORDER")),
        "local_rank": hvd.allgather_object(hvd.local_rank()),
        "executor_dir": hvd.allgather_object(os.getcwd()),
    }


def own_gpus(view: dict) -> list[str]:
    return [visible.split(",")[local] for visible, local in zip(view["visible"], view["local_rank"], strict=False)]


def test_local_ranks_each_get_a_gpu_of_the_host(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, 2))
    view = HorovodRunner(np=-2).run(cuda_view)
    assert view["visible"] == ["0,1", "0,1"] and view["order"] == ["PCI_BUS_ID"] * 2
    assert sorted(own_gpus(view)) == ["0", "1"]
    with pytest.raises(
        LaunchError, match=r"runs 3 ranks on this host, one GPU each, but it has 2 GPU\(s\) \(nvidia-smi -L\)"
    ):
        HorovodRunner(np=-3).run(cuda_view)


def test_local_ranks_follow_the_drivers_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    view = HorovodRunner(np=-2).run(cuda_view)
    assert view["visible"] == ["3,5", "3,5"] and sorted(own_gpus(view)) == ["3", "5"]


def test_a_host_without_gpus_runs_on_the_cpu_as_before(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    view = HorovodRunner(np=-2).run(cuda_view)
    assert view["visible"] == [None, None] and view["order"] == [None, None]


def test_local_torch_processes_take_the_hosts_gpus_without_spark(monkeypatch, tmp_path):
    """No SparkSession: this host's GPUs (nvidia-smi here), num_processes cut to their number as PySpark cuts it
    to the driver's; a host without any refuses use_gpu=True in the constructor."""
    import torch_jobs

    from airflow_provider_hvd import TorchDistributor

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, 2))
    distributor = TorchDistributor(num_processes=3, local_mode=True, use_gpu=True)
    assert distributor.num_processes == 2 and distributor.input_params["num_tasks"] == 2
    views = distributor.run(torch_jobs.gpu_view)["views"]
    assert [view["visible"] for view in views] == ["0,1", "0,1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(LaunchError, match=r"has none \(CUDA_VISIBLE_DEVICES=''\). Pass use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-gpus"), workers=2, cores=2, gpus=2).start()
    yield cluster
    cluster.stop()


def test_spark_ranks_see_the_gpus_spark_gave_their_tasks(gpu_cluster):
    spark = make_session(
        gpu_cluster.url,
        **{
            "spark.executor.cores": "2",
            "spark.cores.max": "4",
            "spark.executor.resource.gpu.amount": "2",
            "spark.task.resource.gpu.amount": "1",
            **gpu_cluster.app_conf,
        },
    )
    try:
        view = HorovodRunner(np=4).run(cuda_view)
    finally:
        spark.stop()
    assert view["order"] == ["PCI_BUS_ID"] * 4
    # all four ranks share this host (127.0.0.1): each sees the host's four GPUs, ordered by local rank ...
    assert len(set(view["visible"])) == 1 and sorted(view["visible"][0].split(",")) == ["0", "1", "2", "3"]
    assert sorted(view["local_rank"]) == [0, 1, 2, 3]
    # ... and its own (the one at its local rank) is one that Spark gave its task, on its own worker
    worker_gpus = {"worker-0": {"0", "1"}, "worker-1": {"2", "3"}}
    for gpu, executor_dir in zip(own_gpus(view), view["executor_dir"], strict=False):
        worker = next(part for part in Path(executor_dir).parts if part.startswith("worker-"))
        assert gpu in worker_gpus[worker], (gpu, executor_dir)
    assert sorted(own_gpus(view)) == ["0", "1", "2", "3"]


def test_the_horovod_build_takes_nccl_with_a_cuda_torch_and_toolkit(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "install_horovod", Path(__file__).parent.parent / "scripts/install_horovod.py"
    )
    build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "install_horovod", build)  # its dataclasses look their module up
    spec.loader.exec_module(build)
    cuda_torch = build.Target("python", "2.13.0+cu128", "12.8", "cp311")
    cpu_torch = build.Target("python", "2.13.0+cpu", None, "cp311")
    (tmp_path / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    gpu = build.choose_variant(cuda_torch)
    assert gpu.name == "cuda12.8" and gpu.env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert build.choose_variant(cpu_torch).name == "cpu"
    assert build.cache_dir(tmp_path, cuda_torch, gpu).name.endswith("-cuda12.8")
    monkeypatch.setenv("PATH", str(tmp_path / "no-toolkit"))
    assert build.choose_variant(cuda_torch).name == "cpu"


def test_gpus_that_limit_np_are_named_and_a_task_with_two_sees_its_own(gpu_cluster):
    spark = make_session(
        gpu_cluster.url,
        **{
            "spark.executor.cores": "2",
            "spark.cores.max": "4",
            "spark.executor.resource.gpu.amount": "2",
            "spark.task.resource.gpu.amount": "2",
            **gpu_cluster.app_conf,
        },
    )
    try:
        started = time.monotonic()
        with pytest.raises(
            LaunchError,
            match=r"has 2 at most .* GPUs are what limits it \(4 on the workers\): "
            r"each executor gets spark.executor.resource.gpu.amount=2, each task "
            r"spark.task.resource.gpu.amount=2",
        ):
            HorovodRunner(np=3).run(cuda_view)
        assert time.monotonic() - started < 30
        view = HorovodRunner(np=2).run(cuda_view)
    finally:
        spark.stop()
    assert sorted(view["visible"]) == ["0,1", "2,3"]  # several GPUs a task: each rank sees its own only


def test_torch_ranks_two_a_task_each_get_one_of_its_gpus(gpu_cluster):
    """TorchDistributor with spark.task.resource.gpu.amount=2: 4 processes in 2 tasks, each one of its task's GPUs."""
    import torch_jobs

    from airflow_provider_hvd import TorchDistributor

    spark = make_session(
        gpu_cluster.url,
        **{
            "spark.executor.cores": "2",
            "spark.cores.max": "4",
            "spark.executor.resource.gpu.amount": "2",
            "spark.task.resource.gpu.amount": "2",
            **gpu_cluster.app_conf,
        },
    )
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks

    try:
        with pytest.raises(RuntimeError) as theirs:  # in the constructor, as PySpark's
            PySparks(num_processes=3, local_mode=False, use_gpu=True)
        with pytest.raises(LaunchError, match=r"'num_processes' value \(3\) must be a multiple of .*\(2\)") as ours:
            TorchDistributor(num_processes=3, local_mode=False, use_gpu=True)
        assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
        with pytest.raises(LaunchError) as too_many:  # 2 slots of 2 GPUs: 4 processes at most
            TorchDistributor(num_processes=8, local_mode=False, use_gpu=True).run(torch_jobs.gpu_view)
        assert str(too_many.value).startswith(
            "TorchDistributor(num_processes=8) runs 2 ranks in each Spark task (one GPU each) and needs 4 slots at once"
        ), too_many.value
        assert "Lower num_processes to at most 4," in str(too_many.value) and "Horovod" not in str(too_many.value)
        distributor = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)
        assert distributor.input_params == PySparks(4, False, True).input_params  # num_tasks 2
        views = distributor.run(torch_jobs.gpu_view)["views"]
        # use_gpu=False on the same cluster: Spark still gives each task its GPUs, and no process sees one
        # (CUDA_VISIBLE_DEVICES="", as PySpark's); before, each saw what its executor saw: every GPU of its host
        hidden = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.gpu_view)
    finally:
        spark.stop()
    assert [view["visible"] for view in hidden["views"]] == ["", ""], hidden
    assert [view["rank"] for view in views] == [0, 1, 2, 3]
    # each task is a torchrun node of 2 processes (as PySpark's): LOCAL_RANK 0 and 1, GROUP_RANK the task's
    assert [(view["group_rank"], view["local_rank"]) for view in views] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # each process sees its task's 2 GPUs (CUDA_VISIBLE_DEVICES), its own at its LOCAL_RANK (cuda:LOCAL_RANK)
    own = [view["visible"].split(",")[view["local_rank"]] for view in views]
    assert sorted(own) == ["0", "1", "2", "3"]
    worker_gpus = {"worker-0": "0,1", "worker-1": "2,3"}
    for view in views:
        worker = next(part for part in Path(view["executor_dir"]).parts if part.startswith("worker-"))
        assert view["visible"] == worker_gpus[worker], view


def test_torch_ranks_over_spark_connect_each_get_one_of_their_tasks_gpus(gpu_cluster, tmp_path, caplog):
    """The same over a Spark Connect server on the cluster: the GPU settings are read through the session. Then the
    same ranks submitted: the run's host takes one CPU and no GPU, so a run with as many ranks as the cluster has
    GPUs starts; its link is TLS 1.3 although the application does not encrypt; and the server's token, which the
    host opens its sessions with, is not in the server's log."""
    import json
    import logging
    import secrets
    import socket
    import ssl

    import torch_jobs
    from connect_server import ConnectServer, connect_session
    from spark_cluster import free_port

    from airflow_provider_hvd import TorchDistributor
    from airflow_provider_hvd.runner.durable.host import open_session
    from airflow_provider_hvd.runner.durable.link import LINK_CONF, LinkAddress
    from airflow_provider_hvd.runner.shared.tls import fingerprint

    server = ConnectServer(
        tmp_path,
        gpu_cluster.url,
        token=f"hvd-token-{secrets.token_hex(12)}",  # (the workers' executors do not have the server's environment)
        **{
            "spark.executor.cores": "2",
            "spark.cores.max": "4",
            "spark.executor.resource.gpu.amount": "2",
            "spark.task.resource.gpu.amount": "2",
            "spark.ui.enabled": "true",  # (the free task slots are counted there)
            "spark.ui.port": str(free_port()),
            **gpu_cluster.app_conf,
        },
    ).start()
    url = server.token_url
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    try:
        with connect_session(url):
            views = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True).run(torch_jobs.gpu_view)["views"]
            job = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True).submit(torch_jobs.gpu_view)
            run_session = open_session(url, json.loads(job.id)["session_id"])
            address = LinkAddress.from_conf(run_session.conf.get(LINK_CONF))
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            with context.wrap_socket(socket.create_connection((address.host, address.port), timeout=10)) as link:
                assert link.version() == "TLSv1.3"
                assert fingerprint(link.getpeercert(binary_form=True)) == address.fingerprint
            submitted = job.wait(180)["views"]
            run_session.client.close()
    finally:
        server.stop()
    for each in (views, submitted):
        assert [(view["group_rank"], view["local_rank"]) for view in each] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        worker_gpus = {"worker-0": "0,1", "worker-1": "2,3"}
        for view in each:
            worker = next(part for part in Path(view["executor_dir"]).parts if part.startswith("worker-"))
            assert view["visible"] == worker_gpus[worker], view
        assert sorted(view["visible"].split(",")[view["local_rank"]] for view in each) == ["0", "1", "2", "3"]
    assert "this run's host listens for its clients at" in caplog.text and ", TLS 1.3" in caplog.text
    assert server.token not in server.log_file.read_text(errors="replace")


def test_torch_on_the_drivers_spark_gpus_and_gpus_set_on_purpose(tmp_path):
    """On a SparkSession, local_mode=True takes the driver's Spark GPUs (spark.driver.resource.gpu.*) as PySpark's
    does; use_gpu=False leaves the executors' CUDA_VISIBLE_DEVICES alone where the application sets it
    (spark.executorEnv.CUDA_VISIBLE_DEVICES: on purpose)."""
    import torch_jobs
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks

    from airflow_provider_hvd import TorchDistributor

    script = tmp_path / "driver-gpus.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(0o755)
    spark = make_session(
        "local[2]",
        **{
            "spark.driver.resource.gpu.amount": "2",
            "spark.driver.resource.gpu.discoveryScript": str(script),
            "spark.executorEnv.CUDA_VISIBLE_DEVICES": "3",
        },
    )
    try:
        distributor = TorchDistributor(num_processes=3, local_mode=True, use_gpu=True)
        assert distributor.input_params == PySparks(3, True, True).input_params  # num_processes cut to 2
        local = distributor.run(torch_jobs.gpu_view)["views"]
        on_purpose = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.gpu_view)
    finally:
        spark.stop()
    assert [view["visible"] for view in local] == ["0,1", "0,1"]
    assert [view["visible"] for view in on_purpose["views"]] == ["3", "3"]
