"""Ranks on a real network: Spark workers on 3 hosts made as network namespaces (tests/hosts.py), each with its own
address, hostname, interface name (eth0 / hvd0) and made-up GPUs, and hosts that vanish mid-run (their link set
down: no FIN, no RST). The bounds asserted are the feature's, with margin for a loaded 2-core machine; the times
measured are printed (``-s``) and given in docs/networks.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import make_session
from host_jobs import (
    allreduce_checkpointing,
    allreduce_forever,
    allreduce_forever_printing,
    allreduce_until_preempted,
)
from hosts import Host, Hosts, cannot_make_hosts
from jobs import alive, assert_all_gone, wait_for_pids
from test_tensorflow import RANKS, assert_sparkdl_examples_ran, sparkdl_examples_and_hosts

from airflow_provider_hvd import HorovodRunner, RankFailedError

_CANNOT = cannot_make_hosts()
pytestmark = [
    pytest.mark.skipif(_CANNOT is not None, reason=f"namespace hosts: {_CANNOT}"),
    pytest.mark.timeout(900),  # JVMs on 3 hosts and a driver start slowly on a loaded 2-core machine
]

CORES, GPUS = [2, 2, 1], [2, 2, 1]
CUT_NAMED_WITHIN_S = 30.0  # a vanished host is named within 30 s (before a surviving rank's 30 s Gloo timeout)
ORPHANS_END_WITHIN_S = 60.0  # the ranks of a host cut off from the driver end by themselves within 60 s


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    hosts = Hosts(tmp_path_factory.mktemp("hosts"), CORES, GPUS).start()
    yield hosts
    hosts.stop()


def session(hosts: Hosts, ranks_per_host: int, ranks: int, **conf: str):
    hosts.wait_idle()  # (each test's placement needs every worker, none held by the test before)
    return make_session(
        hosts.url,
        **{
            **hosts.session_conf(),
            "spark.executor.cores": str(ranks_per_host),
            "spark.cores.max": str(ranks),
            **conf,
        },
    )


def where_and_what(blob: bytes = b"") -> dict:
    """Where each rank runs and what it computed: an allreduce, a DistributedOptimizer model, the blob's digest."""
    import hashlib
    import os
    import socket

    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    torch.manual_seed(1000 + hvd.rank())  # each rank its own data and initial weights
    x = torch.randn(256, 1)
    y = 3 * x - 2
    model = torch.nn.Linear(1, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    me = {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "hostname": socket.gethostname(),
        "iface": os.environ["HOROVOD_GLOO_IFACE"],
        "address": os.environ["HOROVOD_HOSTNAME"],
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "sum": total,
        "loss": loss.item(),
        "weights": (model.weight.item(), model.bias.item()),
        "blob": hashlib.sha256(blob).hexdigest(),
    }
    return {"ranks": hvd.allgather_object(me)}


def check_placement(hosts: Hosts, ranks: list[dict], per_host: int) -> list[Host]:
    """Contiguous ranks per host, local/cross rank and size right, Gloo on each host's own interface."""
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    placed = [hosts.by_address(r["address"]) for r in ranks]
    used = list(dict.fromkeys(placed))
    assert len(used) == len(ranks) // per_host
    for rank in ranks:
        host = hosts.by_address(rank["address"])
        assert (rank["hostname"], rank["iface"]) == (host.name, host.iface), rank
        assert rank["local_rank"] == rank["rank"] % per_host and rank["local_size"] == per_host
        assert rank["cross_rank"] == used.index(host) and rank["cross_size"] == len(used)
        assert placed[rank["rank"] - rank["local_rank"]] is host  # contiguous: the host's first rank is on it too
    assert len({host.iface for host in used}) > 1  # the interface names differ between the hosts
    size = len(ranks)
    assert all(rank["sum"] == size * (size + 1) / 2 for rank in ranks)  # the allreduce crossed the hosts
    assert len({rank["weights"] for rank in ranks}) == 1 and ranks[0]["loss"] < 0.01  # one model on every rank
    return used


def test_four_ranks_on_two_hosts_of_two_cores_with_their_gpus(hosts):
    spark = session(hosts, 2, 4, **{"spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": "1"})
    try:
        ranks = HorovodRunner(np=4).run(where_and_what)["ranks"]
    finally:
        spark.stop()
    used = check_placement(hosts, ranks, per_host=2)
    assert {host.name for host in used} == {"host-0", "host-1"}  # the two hosts with two cores
    # each host's made-up GPUs are "0" and "1": every rank sees both, and its own is the one at its local rank
    assert [rank["gpus"] for rank in ranks] == ["0,1"] * 4
    assert [rank["gpus"].split(",")[rank["local_rank"]] for rank in ranks] == ["0", "1", "0", "1"]


def test_three_ranks_on_three_hosts_and_the_job_broadcast_fetched_on_each(hosts):
    blob = os.urandom(20_000_000)  # the job travels as a Spark broadcast: each host's executor fetches it
    spark = session(hosts, 1, 3)
    try:
        ranks = HorovodRunner(np=3).run(where_and_what, blob=blob)["ranks"]
    finally:
        spark.stop()
    used = check_placement(hosts, ranks, per_host=1)
    assert len(used) == 3
    assert {rank["blob"] for rank in ranks} == {hashlib.sha256(blob).hexdigest()}
    assert [rank["gpus"] for rank in ranks] == [None] * 3  # an application that asks for no GPUs


def _rank_hosts(hosts: Hosts, pid_dir: str, size: int) -> dict[int, tuple[int, Host]]:
    pids = {}
    for rank in range(size):
        pid = int(Path(pid_dir, f"rank-{rank}.pid").read_text())
        pids[rank] = (pid, hosts.by_address(Path(pid_dir, f"host-{rank}").read_text()))
    return pids


def _wait_gone(pids: list[int], within: float) -> float | None:
    """Seconds until every pid has ended (None: not within ``within``)."""
    started = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - started > within:
            return None
        time.sleep(0.1)
    return time.monotonic() - started


class _when_gone(threading.Thread):  # noqa: N801 - used as a function
    """Watches ``pids`` from now on; ``result["at"]``: when the last one ended (absent: not within ``within``)."""

    def __init__(self, pids: list[int], within: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.within, self.result = pids, within, {}
        self.start()

    def run(self) -> None:
        if _wait_gone(self.pids, self.within) is not None:
            self.result["at"] = time.monotonic()


def _start_run(runner: HorovodRunner, pid_dir: str, size: int, job=allreduce_forever) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = runner.run(job, pid_dir=pid_dir)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for_pids(pid_dir, size, timeout=400)
    return thread, outcome


def processes(host: Host, marker: str) -> list[tuple[int, str]]:
    """The processes on ``host`` whose command line holds ``marker``."""
    found = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if marker in cmdline:
            found.append((pid, cmdline[:120]))
    return found


def ranks_left(hosts: list[Host], within: float = 10.0) -> list[tuple[int, str]]:
    """The rank processes (or their reapers) still running on ``hosts`` after up to ``within`` seconds (a reaper
    exits just after its rank: on a loaded machine, that can be a while)."""
    deadline = time.monotonic() + within
    while True:
        left = [
            p
            for host in hosts
            for marker in ("airflow_provider_hvd.runner.rank", "reaper.py")
            for p in processes(host, marker)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.parametrize("chatty", [False, True], ids=["quiet", "every-rank-printing"])
def test_a_host_cut_off_mid_run_is_named_and_its_ranks_end_by_themselves(hosts, pid_dir, chatty, monkeypatch):
    """Also while every rank floods the driver with output at "all": relaying it must not starve the check."""
    monkeypatch.setattr(logging.getLogger(RANKS), "propagate", False)  # relayed, not kept by pytest's capture
    spark = session(hosts, 2, 4)
    cut: Host | None = None
    try:
        runner = HorovodRunner(np=4, driver_log_verbosity="all" if chatty else "log_callback_only")
        thread, outcome = _start_run(runner, pid_dir, 4, allreduce_forever_printing if chatty else allreduce_forever)
        placed = _rank_hosts(hosts, pid_dir, 4)
        cut = placed[2][1]
        orphans = [pid for pid, host in placed.values() if host is cut]
        orphans_gone = _when_gone(orphans, CUT_NAMED_WITHIN_S + ORPHANS_END_WITHIN_S)
        cut.cut()
        cut_at = time.monotonic()
        thread.join(CUT_NAMED_WITHIN_S + 30)
        assert not thread.is_alive(), "run() did not end after a host was cut off"
        named_after = outcome["ended"] - cut_at
        error = outcome["error"]
        assert isinstance(error, RankFailedError), repr(error)
        assert error.rank == 2
        assert str(error).startswith(
            f"Horovod ranks 2 and 3 of 4 failed: their host {cut.name} ({cut.address}) was "
            "lost: nothing heard from any of their agents for "
        ), str(error)
        assert named_after < CUT_NAMED_WITHIN_S, str(error)
        others = [pid for pid, host in placed.values() if host is not cut]
        assert _wait_gone(others, 15) is not None, "a rank on a healthy host outlived the run"
        orphans_gone.join()
        assert "at" in orphans_gone.result, "the cut-off host's ranks did not end"
        orphans_ended = orphans_gone.result["at"] - cut_at
        print(
            f"\nMEASURED host cut ({'every rank printing' if chatty else 'quiet'}): named after {named_after:.1f}s; "
            f"its ranks ended {orphans_ended:.1f}s after the cut"
        )
        assert orphans_ended < ORPHANS_END_WITHIN_S
        cut.reconnect()
        cut = None
        assert not ranks_left([placed[2][1]]), "a rank was left on the host whose link came back"
    finally:
        if cut is not None:
            cut.reconnect()
        spark.stop()


def test_the_drivers_host_cut_off_from_every_worker_ends_every_rank(hosts, pid_dir):
    spark = session(hosts, 1, 3)
    used: list[Host] = []
    try:
        thread, outcome = _start_run(HorovodRunner(np=3), pid_dir, 3)
        placed = _rank_hosts(hosts, pid_dir, 3)
        used = list({host.index: host for _, host in placed.values()}.values())
        for host in used:
            host.cut()
        cut_at = time.monotonic()
        ended_after = _wait_gone([pid for pid, _ in placed.values()], ORPHANS_END_WITHIN_S + 10)
        assert ended_after is not None, "ranks outlived the driver's host being cut off"
        print(f"\nMEASURED driver cut off: every rank ended {time.monotonic() - cut_at:.1f}s after the cut")
        assert time.monotonic() - cut_at < ORPHANS_END_WITHIN_S
        thread.join(60)
        assert isinstance(outcome.get("error"), RankFailedError) and "was lost" in str(outcome["error"])
        for host in used:
            host.reconnect()
        used = []
        assert not ranks_left([host for _, host in placed.values()])
    finally:
        for host in used:
            host.reconnect()
        spark.stop()


DRIVER = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession
    sys.path.insert(0, {tests!r})
    from host_jobs import allreduce_forever
    from airflow_provider_hvd import HorovodRunner
    builder = SparkSession.builder.master({url!r}).appName("hvd-driver-killed")
    for key, value in json.loads({conf!r}).items():
        builder = builder.config(key, value)
    builder.getOrCreate()
    HorovodRunner(np=4).run(allreduce_forever, pid_dir={pid_dir!r})
""")


def test_a_driver_killed_ends_every_rank_on_every_host(hosts, pid_dir, tmp_path):
    """SIGKILL the driver's process group (as when the Airflow task's worker dies): every rank on every host ends."""
    import json

    hosts.wait_idle()
    conf = {**hosts.session_conf(), "spark.executor.cores": "2", "spark.cores.max": "4", "spark.ui.enabled": "false"}
    script = tmp_path / "driver.py"
    script.write_text(
        DRIVER.format(tests=str(Path(__file__).parent), url=hosts.url, conf=json.dumps(conf), pid_dir=pid_dir)
    )
    env = {**os.environ, "SPARK_LOCAL_IP": hosts.driver_address}
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen(
            [sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        try:
            wait_for_pids(pid_dir, 4, timeout=400)
        except TimeoutError:
            pytest.fail((tmp_path / "driver.log").read_text()[-3000:])
        pids = [pid for pid, _ in _rank_hosts(hosts, pid_dir, 4).values()]
        os.killpg(driver.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        ended_after = _wait_gone(pids, ORPHANS_END_WITHIN_S + 10)
        assert ended_after is not None, "ranks outlived their driver"
        print(f"\nMEASURED driver killed: every rank ended {ended_after:.1f}s after")
        assert time.monotonic() - killed_at < ORPHANS_END_WITHIN_S
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        driver.wait()


def test_an_executor_killed_on_one_host_is_named_within_10_s(hosts, pid_dir):
    spark = session(hosts, 2, 4)
    try:
        thread, outcome = _start_run(HorovodRunner(np=4), pid_dir, 4)
        placed = _rank_hosts(hosts, pid_dir, 4)
        host = placed[0][1]
        [(executor, _)] = processes(host, "CoarseGrainedExecutorBackend")
        os.kill(executor, signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(60)
        named_after = outcome["ended"] - killed_at
        error = outcome["error"]
        assert isinstance(error, RankFailedError), repr(error)
        assert error.rank in (0, 1) and f"({host.address})" in str(error), str(error)
        print(f"\nMEASURED executor killed: named after {named_after:.1f}s: {str(error).splitlines()[0]}")
        assert named_after < 10.0
        assert _wait_gone([pid for pid, _ in placed.values()], 20) is not None
    finally:
        spark.stop()


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed (make setup)")
def test_tensorflow_ranks_on_two_hosts(hosts, caplog):
    caplog.set_level(logging.INFO, logger=RANKS)
    spark = session(hosts, 1, 2)
    try:
        result = HorovodRunner(np=2).run(sparkdl_examples_and_hosts)
    finally:
        spark.stop()
    assert len(set(result["hosts"])) == 2, result["hosts"]  # one rank on each of two hosts
    assert_sparkdl_examples_ran(result, caplog)  # the same weights on both, LogCallback's lines relayed


def test_torch_ranks_on_two_hosts(hosts):
    """TorchDistributor: a DDP rank on each of two hosts, Gloo on each host's own interface, the driver's store."""
    import torch_jobs
    from test_torch_distributor import check_torchrun_contract

    from airflow_provider_hvd import TorchDistributor

    spark = session(hosts, 1, 2)
    try:
        result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.train_ddp, 5)
    finally:
        spark.stop()
    views = result["views"]
    check_torchrun_contract(views, nodes=2)
    placed = [next(host for host in hosts.hosts if host.name == view["host"]) for view in views]
    assert len(set(placed)) == 2, [view["host"] for view in views]
    assert [view["gloo_iface"] for view in views] == [host.iface for host in placed]
    assert {view["env"]["MASTER_ADDR"] for view in views} == {hosts.driver_address}


def test_a_dataframes_rows_reach_ranks_on_two_hosts_and_their_files_go_with_the_run(hosts, tmp_path):
    """train_on_dataframe with a DDP rank on each of two hosts: each rank its own shard (together every row, one
    row apart at most), and no process holds a shard file once the run is over."""
    from dataframe_jobs import by_value, ddp_ids_and_hosts
    from test_dataframe_feed import holders_of_files

    from airflow_provider_hvd import TorchDistributor

    spark = session(hosts, 1, 2)
    try:
        df = spark.range(0, 3001, numPartitions=5)
        with by_value(ddp_ids_and_hosts):
            views = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).train_on_dataframe(
                ddp_ids_and_hosts, df, str(tmp_path)
            )
    finally:
        spark.stop()
    placed = {next(host for host in hosts.hosts if host.name == view["host"]) for view in views}
    assert len(placed) == 2, [view["host"] for view in views]
    first, second = (view["ids"] for view in views)
    assert sorted(first + second) == list(range(3001)) and not set(first) & set(second)
    assert abs(len(first) - len(second)) == 1
    links, held = holders_of_files(tmp_path, 2)
    assert all(link.endswith(" (deleted)") for link in links) and held == [], (links, held)


def _cut_a_host_mid_run(
    hosts: Hosts, runner: HorovodRunner, pid_dir: str, job=allreduce_forever, ready=lambda: True
) -> tuple[dict, Host, dict[int, tuple[int, Host]]]:
    """``runner``'s run of 4 ranks, 2 on each of two hosts, the host of ranks 2 and 3 cut off once ``ready()``:
    run()'s outcome once it ended, the host cut off, and where the ranks were."""
    spark = session(hosts, 2, 4)
    cut: Host | None = None
    try:
        thread, outcome = _start_run(runner, pid_dir, 4, job)
        placed = _rank_hosts(hosts, pid_dir, 4)
        while not ready():
            assert thread.is_alive(), repr(outcome)
            time.sleep(0.1)
        cut = placed[2][1]
        cut.cut()
        thread.join(CUT_NAMED_WITHIN_S + 90)
        assert not thread.is_alive(), "run() did not end after a host was cut off"
    finally:
        if cut is not None:
            cut.reconnect()
        spark.stop()
    return outcome, cut, placed


def test_a_host_cut_off_with_min_ranks_at_the_runs_size_fails_after_the_bounded_wait_saying_what_it_waited_for(
    hosts, pid_dir
):
    """HorovodRunner(np=4, max_restarts=1) (min_ranks: the run's own 4): one host cut off, the restart waits
    slot_wait_timeout for 4 free slots where Spark has 2, then fails saying what it waited for and how to go on;
    the other host's ranks are gone (the cut host's end by themselves: the cut-off test above). Before the test
    below, whose host is cut off for most of a minute: after that, under load, the cut host's worker took no
    executor for minutes; this test's cut lasts seconds, as the tests' above."""
    runner = HorovodRunner(np=4, max_restarts=1, slot_wait_timeout=5)
    outcome, cut, placed = _cut_a_host_mid_run(hosts, runner, pid_dir)
    error = outcome.get("error")
    assert error is not None, repr(outcome)
    waited = re.search(
        r"could not restart after attempt 1 \(Horovod ranks 2 and 3 of 4 failed: their host .+ was lost.+\): "
        r"waited (\d+)s for 4 ranks' free Spark task slots \(min_ranks=4 of HorovodRunner\(np=4\)\) on spark://\S+, "
        rf"and the application has 2 free \(the executors on {re.escape(cut.address)}, lost with the last attempt, "
        r"are not counted\)\. Set min_ranks lower to go on with fewer ranks, .+ \(slot_wait_timeout, now 5s\)\.",
        str(error),
    )
    assert waited, str(error)
    assert int(waited[1]) <= 15, str(error)  # slot_wait_timeout, not shrink_timeout (30 s), which cannot apply
    assert [(a["size"], a["cause_kind"]) for a in runner.attempts] == [(4, "host_lost")]
    survivors = [pid for pid, host in placed.values() if host is not cut]
    assert_all_gone(survivors, within=30)


def test_a_host_cut_off_with_min_ranks_below_the_runs_goes_on_with_the_ranks_left_from_the_last_checkpoint(
    hosts, pid_dir, caplog
):
    """HorovodRunner(np=4, max_restarts=1, min_ranks=2): 2 ranks on each of two hosts, one host cut off after a
    checkpoint. Spark has no slot in its place (the third host's one core holds no 2-core executor): the restart
    runs the 2 ranks the other host holds, from the last checkpoint, and returns."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    runner = HorovodRunner(np=4, max_restarts=1, min_ranks=2, shrink_timeout=1)

    def checkpointed() -> bool:
        return bool(list(Path(pid_dir).glob("epoch-*.ckpt")))

    outcome, cut, _ = _cut_a_host_mid_run(hosts, runner, pid_dir, allreduce_checkpointing, checkpointed)
    result = outcome.get("value")
    assert result is not None, repr(outcome.get("error"))
    assert result["size"] == 2 and result["epochs"] == 3 and cut.address not in result["hosts"]
    assert [(a["size"], a["cause_kind"]) for a in runner.attempts] == [(4, "host_lost"), (2, None)]
    restart = (
        rf"HorovodRunner: restart 1 of 1 after Horovod ranks 2 and 3 of 4 failed: their host {cut.name} .+: 2 ranks "
        rf"instead of 4, resuming from .+epoch-{result['resumed_from']['epoch']}\.ckpt \(epoch=\d+\)"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "airflow_provider_hvd.runner"]
    assert [line for line in lines if re.fullmatch(restart, line)], lines


# last in the module: the worker it decommissions takes no executor again


def test_a_worker_decommissioned_mid_run_tells_the_ranks_and_the_run_goes_on_with_fewer_from_their_checkpoint(
    hosts, pid_dir, caplog
):
    """HorovodRunner(np=4, max_restarts=1, min_ranks=2): 2 ranks on each of two hosts, and one host's worker given
    SIGPWR (a standalone worker being decommissioned). Every rank reads the notice and its deadline
    (``preemption_notice()``); rank 0 then reports a checkpoint; the run starts again from it with the 2 ranks the
    other host holds (the third host's one core holds no 2-core executor), and that restart is not counted."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    grace = {"spark.decommission.enabled": "true", "spark.executor.decommission.forceKillTimeout": "100s"}
    spark = session(hosts, 2, 4, **grace)
    try:
        runner = HorovodRunner(np=4, max_restarts=1, min_ranks=2, shrink_timeout=1)
        thread, outcome = _start_run(runner, pid_dir, 4, allreduce_until_preempted)
        placed = _rank_hosts(hosts, pid_dir, 4)
        going = placed[2][1]
        first = [pid for pid, _ in placed.values()]
        [(worker, _)] = processes(going, "org.apache.spark.deploy.worker.Worker")
        os.kill(worker, signal.SIGPWR)
        told_at = time.monotonic()
        thread.join(240)
        assert not thread.is_alive(), "run() did not end after a worker was decommissioned"
    finally:
        spark.stop()
    result = outcome.get("value")
    assert result is not None, repr(outcome.get("error"))
    notices = [json.loads(Path(pid_dir, f"notice-{rank}.json").read_text()) for rank in range(4)]
    assert {notice["deadline"] - notice["at"] for notice in notices} == {100.0}
    assert {(tuple(notice["hosts"]), tuple(notice["ranks"])) for notice in notices} == {((going.address,), (2, 3))}
    assert result["resumed_from"]["epoch"] == max(notice["epoch"] for notice in notices)  # (once all were told)
    assert result["size"] == 2 and result["epochs"] == 3
    assert going.address not in result["hosts"]
    assert [(a["size"], a["cause_kind"], a["preempted"]) for a in runner.attempts] == [
        (4, "preempted", True),
        (2, None, False),
    ]
    restart = (
        r"HorovodRunner: restart after a preemption \(not counted in max_restarts=1\) after .+: 2 ranks instead "
        r"of 4, resuming from .+epoch-\d+\.ckpt \(epoch=\d+\)"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "airflow_provider_hvd.runner"]
    assert [line for line in lines if re.fullmatch(restart, line)], lines
    assert _wait_gone(first, 30) is not None, "a rank of the first attempt outlived the run"
    print(f"\nMEASURED decommission: run() returned {outcome['ended'] - told_at:.1f}s after SIGPWR")
