"""TorchDistributor: plain torch.distributed ranks (DDP, FSDP2) on this runner, locally and on Spark, no Horovod."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch_jobs
from pysparks import pysparks_result
from rank_lines import lines_by_rank

from airflow_provider_hvd import RankFailedError, RunStalledError, TorchDistributor
from airflow_provider_hvd.runner.agent.rank_env import keras_defaults
from airflow_provider_hvd.runner.driver.verdict.consequences import GLOO_PEER_GONE, is_consequence_error
from airflow_provider_hvd.runner.shared.messages import RemoteError

ROOT = Path(__file__).resolve().parent.parent


def check_torchrun_contract(views: list[dict], nodes: int = 1) -> None:
    """Every process got torchrun's env:// variables for one run of len(views) ranks on ``nodes`` nodes (this
    host for local runs, each Spark task on Spark: as PySpark runs torchrun in each task)."""
    size = len(views)
    assert [view["env"]["RANK"] for view in views] == [str(rank) for rank in range(size)]
    assert {view["env"]["WORLD_SIZE"] for view in views} == {str(size)}
    assert {view["env"]["ROLE_WORLD_SIZE"] for view in views} == {str(size)}
    assert [view["env"]["ROLE_RANK"] for view in views] == [view["env"]["RANK"] for view in views]
    per_node = size // nodes
    assert {view["env"]["GROUP_WORLD_SIZE"] for view in views} == {str(nodes)}
    assert [view["env"]["GROUP_RANK"] for view in views] == [str(rank // per_node) for rank in range(size)]
    assert {view["env"]["LOCAL_WORLD_SIZE"] for view in views} == {str(per_node)}
    assert [view["env"]["LOCAL_RANK"] for view in views] == [str(rank % per_node) for rank in range(size)]
    assert len({view["env"]["TORCHELASTIC_RUN_ID"] for view in views}) == 1
    assert len({(view["env"]["MASTER_ADDR"], view["env"]["MASTER_PORT"]) for view in views}) == 1
    assert {view["env"]["TORCHELASTIC_USE_AGENT_STORE"] for view in views} == {"True"}
    assert {view["env"]["ROLE_NAME"] for view in views} == {"default"}
    assert all(view["torchelastic"] for view in views)  # torch.distributed.is_torchelastic_launched()
    assert len({view["pid"] for view in views}) == size


# The environments of PySpark's processes and of ours, key by key: what differs is in docs/torch-distributor.md's
# "Different" table. Not compared: values that are the run's or the process's own (its store's port, run id, error
# file, Spark's worker secret), and this runner's own HVD_RUNNER_* variables.
OWN_VALUES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PYTHON_WORKER_FACTORY_SECRET"}
ONLY_OURS = {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", *keras_defaults()}
ENV_DIFFERENCES = {  # by local_mode
    False: {
        "only PySpark's": {"PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID", "SPARK_SIMPLIFIED_TRACEBACK"},
        "only ours": ONLY_OURS,
        "other values": {"MASTER_ADDR", "PYTHONUNBUFFERED"},
    },
    True: {"only PySpark's": set(), "only ours": {*ONLY_OURS, "NODE_RANK"}, "other values": {"MASTER_ADDR"}},
}


def env_differences(ours: dict[str, str], pysparks: dict[str, str]) -> dict[str, set[str]]:
    return {
        "only PySpark's": set(pysparks) - set(ours),
        "only ours": {name for name in set(ours) - set(pysparks) if not name.startswith("HVD_RUNNER_")},
        "other values": {name for name in (set(ours) & set(pysparks)) - OWN_VALUES if ours[name] != pysparks[name]},
    }


@contextlib.contextmanager
def torch_jobs_by_value():
    """PySpark's processes do not have the tests' modules: torch_jobs goes by value with its functions."""
    from pyspark import cloudpickle as pyspark_cloudpickle

    pyspark_cloudpickle.register_pickle_by_value(torch_jobs)
    try:
        yield
    finally:
        pyspark_cloudpickle.unregister_pickle_by_value(torch_jobs)


def test_ddp_on_processes_of_this_host():
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(torch_jobs.train_ddp, steps=5)
    check_torchrun_contract(result["views"])
    assert {view["gloo_iface"] for view in result["views"]} == {"lo"}  # the interface that reaches the driver
    env = result["views"][0]["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):  # the driver's store ended with the run
        socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), timeout=5).close()


def test_progress_and_logs_of_torch_ranks(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd.ranks")
    runner = TorchDistributor(2, True, False, resume_from={"path": "/ckpt/step-1.pt"})
    assert runner.run(torch_jobs.report_progress, str(tmp_path)) == 0
    assert runner.metrics == {"loss": [(1, 1.5), (2, 2.5)]}  # rank 0's: the mean of step + rank over the ranks
    assert runner.checkpoint is not None and runner.checkpoint["path"] == str(tmp_path / "step-2.pt")
    assert runner.checkpoint["step"] == 2 and runner.checkpoint["rank"] == 0
    lines = [record.getMessage() for record in caplog.records if record.name == "airflow_provider_hvd.ranks"]
    for rank in (0, 1):
        assert any(f"rank {rank} resumed from /ckpt/step-1.pt" in line for line in lines), lines


def test_a_stalled_torch_run_says_where_each_rank_was():
    with pytest.raises(RunStalledError) as caught:
        TorchDistributor(2, True, False, stall_timeout=4).run(torch_jobs.hang_in_a_collective)
    text = str(caught.value)
    assert caught.value.ranks == [0, 1], text
    assert "was in hang_in_a_collective" in text, text
    assert "all_reduce" in caught.value.stacks[0], caught.value.stacks[0]


def test_ddp_on_spark_gives_pysparks_weights(spark_local, capfd):
    """The same seeded DDP function on local[2]: this class and PySpark's own TorchDistributor end with the same
    weights, bit for bit; each process's environment differs from PySpark's in the documented keys only."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor

    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.train_ddp, 20)
    check_torchrun_contract(ours["views"], nodes=2)  # one process per task, each task a node
    with torch_jobs_by_value():
        pysparks = PySparkTorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        theirs = pysparks_result(lambda: pysparks.run(torch_jobs.train_ddp, 20), capfd)
    assert len(ours["weights"]) == len(theirs["weights"]) == 4
    for mine, pysparks in zip(ours["weights"], theirs["weights"], strict=True):
        assert torch.equal(mine, pysparks)
    assert ours["loss"] == theirs["loss"]
    for mine, pysparks in zip(ours["views"], theirs["views"], strict=True):  # each process's environment
        assert env_differences(mine["env"], pysparks["env"]) == ENV_DIFFERENCES[False]
        assert mine["env"]["NODE_RANK"] == pysparks["env"]["NODE_RANK"] == mine["env"]["GROUP_RANK"]


def test_local_processes_get_pysparks_environment(spark_local):
    """local_mode=True: PySpark's processes (torchrun on the driver's host) and ours, key by key."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor

    ours = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(torch_jobs.environment)
    with torch_jobs_by_value():
        theirs = PySparkTorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(torch_jobs.environment)
    for mine, pysparks in zip(ours, theirs, strict=True):
        assert env_differences(mine, pysparks) == ENV_DIFFERENCES[True]
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith("/error.json") and mine["NODE_RANK"] == "0"


def test_every_difference_in_the_environment_is_documented():
    table = (ROOT / "docs" / "torch-distributor.md").read_text().split("## Different", 1)[1]
    named = {name for differences in ENV_DIFFERENCES.values() for names in differences.values() for name in names}
    assert not {name for name in named if not re.search(f"`{name}[`=]", table)}


def test_every_line_a_process_prints_reaches_the_driver_by_default(spark_local, caplog):
    """As PySpark's: the processes' output reaches the driver's log without asking (driver_log_verbosity="all")."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd.ranks")
    runner = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert runner.run(torch_jobs.print_a_line) == 0
    relayed = lines_by_rank(caplog.records)
    assert relayed.get(0) == ["process 0 of 2 says hello"] and relayed.get(1) == ["process 1 of 2 says hello"], relayed


def test_fsdp2_fully_shard_trains_on_the_cpu():
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(torch_jobs.train_fsdp2)
    assert result["param_type"] == "DTensor"
    assert result["shard_rows"] * 2 == result["rows"]  # each rank holds half of the first layer's rows
    assert result["losses"][0] == result["losses"][1]


def test_the_failing_rank_is_named_first_and_torchs_errors_are_consequences(spark_local):
    runner = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(RankFailedError) as caught:
        runner.run(torch_jobs.fail_inside_collective, "rank 1 broke")
    error = caught.value
    assert error.rank == 1
    assert str(error).splitlines()[0] == "torch.distributed rank 1 of 2 failed: ValueError: rank 1 broke"
    assert "in fail_inside_collective" in (error.remote_traceback or "")
    assert len(error.other_failures) == 1 and "rank 0" in error.other_failures[0]
    # rank 0's own error, torch's reaction to its peer gone, listed after the cause as its consequence (on a
    # loaded machine rank 0 may report it only after the driver's 1 s window: then the driver ended it)
    other = error.other_failures[0]
    if "ended by the driver" not in other:
        # Gloo's words for a peer gone depend on which side saw the socket end first
        assert "gloo" in other and any(words in other for words in GLOO_PEER_GONE), other
        assert other.endswith("(a consequence of rank 1's failure)"), other


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("DistBackendError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:5"),
        ("DistStoreError", "wait timeout after 300000ms, keys: /worker/default_pg/0//cpu//0"),
        ("DistNetworkError", "failed to recv, got 0 bytes"),
        ("RuntimeError", "[gloo] Connection reset by peer"),
        ("RuntimeError", "terminate called after throwing an instance of 'c10::DistBackendError'"),
        ("RuntimeError", "[PG 0 Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)"),
    ],
)
def test_torchs_reactions_to_a_peer_gone_are_consequences(kind, message):
    assert is_consequence_error(RemoteError(kind, message, ""))


def test_a_real_error_is_no_consequence():
    assert not is_consequence_error(RemoteError("ValueError", "rank 1 broke", ""))
    assert not is_consequence_error(RemoteError("RuntimeError", "CUDA out of memory", ""))


def test_a_python_file_runs_with_its_arguments(spark_local, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            out = sys.argv[1]
            with open(os.path.join(out, f"rank-{dist.get_rank()}.txt"), "w") as f:
                f.write(" ".join(sys.argv[2:]) + f" sum={t.item()} name={__name__}")
            """
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    assert TorchDistributor(2, False, False).run(str(script), str(out), "--lr", 0.5) is None
    assert sorted(path.read_text() for path in out.iterdir()) == ["--lr 0.5 sum=1.0 name=__main__"] * 2
    with pytest.raises(ValueError, match="key-word"):
        TorchDistributor(2, False, False).run(str(script), lr=0.5)


def test_a_file_that_is_not_on_the_rank_host_travels_with_the_job(tmp_path):
    """run_script writes the driver's copy where the path does not hold it (an executor without the file)."""
    code = textwrap.dedent(
        f"""
        import sys
        from airflow_provider_hvd.runner.rank.script import run_script
        run_script({str(tmp_path / "gone" / "train.py")!r}, b"import sys; print(__file__, sys.argv[1:])", ["a", "1"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    path, argv = out.split(" ", 1)
    assert path.endswith("/train.py") and "hvd-script-" in path and argv.strip() == "['a', '1']"
    assert not Path(path).exists()  # removed when the process exited


def test_the_attributes_that_pyspark_code_reads(spark_local):
    """input_params, num_processes, local_mode, use_gpu, num_tasks, ssl_conf: PySpark's values, on the same
    session (PySpark's constructor reads its conf and starts nothing)."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks

    for args in [(1, True, False), (2, True, False), (2, False, False), (3, False, False)]:
        ours, theirs = TorchDistributor(*args), PySparks(*args)
        for name in ("input_params", "num_processes", "local_mode", "use_gpu", "num_tasks", "ssl_conf"):
            assert getattr(ours, name) == getattr(theirs, name), (args, name, getattr(ours, name))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_processes": 0, "use_gpu": False},
        {},  # use_gpu=True, local_mode=True: the driver's GPUs, and the session has none
        {"num_processes": 2, "local_mode": True, "use_gpu": True},
        {"num_processes": 2, "local_mode": False, "use_gpu": True},  # no spark.task.resource.gpu.amount
    ],
)
def test_the_constructor_refuses_what_pysparks_refuses(spark_local, kwargs):
    """The same exception type (ours may be a subclass), its message beginning with PySpark's (the fix follows)."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks

    with pytest.raises(Exception) as theirs:
        PySparks(**kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        TorchDistributor(**kwargs)
    assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
    if isinstance(ours.value, RuntimeError):
        assert "use_gpu=False" in str(ours.value)  # and it names the fix


_NO_HOROVOD = """
import importlib.abc, sys

class _NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoHorovod())
"""


def test_a_run_without_horovod(tmp_path):
    """Where `import horovod` fails (driver and ranks): TorchDistributor runs, HorovodRunner says what is missing."""
    (tmp_path / "sitecustomize.py").write_text(_NO_HOROVOD)
    code = textwrap.dedent(
        """
        import sys, torch_jobs
        from airflow_provider_hvd import HorovodRunner, LaunchError, TorchDistributor
        try:
            import horovod
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("horovod imported")
        result = TorchDistributor(num_processes=2, use_gpu=False).run(torch_jobs.modules_loaded)
        assert result == {"sum": 2.0, "horovod": []}, result
        assert not [name for name in sys.modules if name.startswith("horovod")]
        try:
            HorovodRunner(np=-1).run(print)
        except LaunchError as exc:
            print("LaunchError:", exc)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LaunchError: HorovodRunner needs Horovod" in done.stdout
