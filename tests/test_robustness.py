"""Nothing hangs, leaks or goes unseen: runs that return with work left behind, many runs, runs side by side."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from jobs import allreduce_sum, assert_all_gone

from airflow_provider_hvd import HorovodRunner, RankFailedError
from airflow_provider_hvd.runner.agent import rank_env
from airflow_provider_hvd.runner.driver.launch.spark.cluster import is_local
from airflow_provider_hvd.runner.driver.ranks import horovod as gloo_rendezvous
from airflow_provider_hvd.runner.driver.ranks.plan import plan_by_node
from airflow_provider_hvd.runner.driver.watch import channel
from airflow_provider_hvd.runner.shared import wire

TESTS = Path(__file__).resolve().parent


def return_with_a_thread_running() -> str:
    import threading
    import time

    threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: Python would wait for it
    return "returned"


def return_with_a_child_holding_stdout(path: str) -> str:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(path, "a").write(f"{child.pid}\n")
    return "returned"


def test_a_thread_left_running_does_not_hold_the_run():
    started = time.monotonic()
    assert HorovodRunner(np=-2).run(return_with_a_thread_running) == "returned"
    assert time.monotonic() - started < 20


def test_a_child_holding_the_output_open_does_not_hold_the_run(tmp_path):
    pids = tmp_path / "children"
    started = time.monotonic()
    assert HorovodRunner(np=-2).run(return_with_a_child_holding_stdout, path=str(pids)) == "returned"
    assert time.monotonic() - started < 20
    assert_all_gone([int(pid) for pid in pids.read_text().split()], within=5)


def trivial() -> int:
    return 1


def py4j_ports() -> set[int]:
    """The ports of this process's Py4J gateway to a Spark JVM: PySpark opens and closes connections to it as
    its own threads come and go (a connection the JVM reset is replaced), which no run of ours does."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return set()
    ports = {gateway.gateway_parameters.port}
    if (callback := gateway.get_callback_server()) is not None:
        ports.add(callback.get_listening_port())
    return ports


def resources() -> tuple[list[str], list[str], set[int]]:
    """This process's threads, sockets (but those to the suite's Spark JVM) and live child processes (the suite's
    Spark JVMs among them)."""
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    py4j = py4j_ports()
    sockets = sorted(
        f"{c.type.name} {c.laddr} {c.raddr} {c.status}"
        for c in me.net_connections("all")
        if getattr(c.raddr, "port", None) not in py4j and getattr(c.laddr, "port", None) not in py4j
    )
    return sorted(t.name for t in threading.enumerate()), sockets, children


def test_twenty_runs_leave_no_thread_socket_or_process():
    HorovodRunner(np=-2).run(trivial)  # imports and lazily created pools are there from the first run on
    before = resources()
    for _ in range(20):
        assert HorovodRunner(np=-2).run(trivial) == 1
    assert resources() == before


def test_two_runs_at_once_in_one_process():
    results: dict[int, object] = {}

    def run(base: float) -> None:
        try:
            results[int(base)] = HorovodRunner(np=-2).run(allreduce_sum, base=base)
        except Exception as exc:  # noqa: BLE001
            results[int(base)] = exc

    threads = [threading.Thread(target=run, args=(float(base),)) for base in (10, 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {
        10: {"rank": 0, "size": 2, "local_size": 2, "sum": 23.0},
        20: {"rank": 0, "size": 2, "local_size": 2, "sum": 43.0},
    }


SCRIPT = """
import logging, sys, threading, time
sys.path.insert(0, {tests!r})
logging.basicConfig()  # the root logger at WARNING, as in most scripts and notebooks
from airflow_provider_hvd import HorovodRunner

def early():
    from airflow_provider_hvd import log_to_driver
    print("early print")
    log_to_driver("early message")

def late():
    import time
    time.sleep(3)
    print("late print")

threads = [threading.Thread(target=HorovodRunner(np=-1).run, args=(f,)) for f in (early, late)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def test_relayed_lines_show_under_basic_logging_config_with_two_runs_at_once():
    """sparkdl prints them; a run that ends first must not hide the other's."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=str(TESTS))], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank 0] early print" in proc.stderr
    assert "[rank 0] early message" in proc.stderr
    assert "[rank 0] late print" in proc.stderr


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("no network interface holds 10.1.2.3, the address this host uses to reach the driver"),
        OSError(24, "Too many open files"),
    ],
)
def test_an_agents_own_failure_reaches_the_driver(monkeypatch, error):
    def failing_agent_environment(*args, **kwargs):
        raise error

    monkeypatch.setattr(rank_env, "interface_of", failing_agent_environment)  # local agents run in this process
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(trivial)
    assert "the HorovodRunner agent of rank" in str(info.value)
    assert f"failed: {type(error).__name__}: {error}" in str(info.value)
    assert "--- the agent's traceback ---" in str(info.value)


def wait_for_file(path: str) -> int:
    import os
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 1


def threads_but_the_agents() -> int:
    """This process's threads, but those of the local agents (in this process too), which start theirs as their
    rank goes on."""
    agents = ("hvd-local-agent-", "hvd-agent-", "hvd-rank")
    return sum(1 for thread in threading.enumerate() if not thread.name.startswith(agents))


def test_many_silent_connections_hold_no_thread_for_long(caplog, monkeypatch, tmp_path):
    """Connections that never prove the secret: one thread serves them all, each is closed once the handshake
    timeout has passed (those beyond the most served at once wait their turn), and the run goes on."""
    monkeypatch.setattr(channel, "MAX_PENDING_HANDSHAKES", 16)
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT_S", 1.0)
    release = tmp_path / "release"
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("v", HorovodRunner(np=-2).run(wait_for_file, path=str(release)))
    )
    thread.start()
    deadline = time.monotonic() + 30
    while "ranks started" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    # (the records, not caplog.text: later in a full run's worker it is rendered as JSON, by a formatter not ours)
    said = next(r.getMessage() for r in caplog.records if "driver channel on " in r.getMessage())
    host, port = said.split("driver channel on ")[1].split()[0].rstrip(",").split(":")
    threads_before = threads_but_the_agents()
    opened = time.monotonic()
    silent = [socket.create_connection((host, int(port))) for _ in range(3 * 16)]  # 16 served, 32 queued
    time.sleep(0.5)  # (time for a thread a connection to start, were there one)
    assert threads_but_the_agents() <= threads_before  # one thread serves every connection
    closed_after = []
    try:
        for sock in silent:
            sock.settimeout(15)
            while sock.recv(1 << 16):  # the driver's nonce, then its end
                pass
            closed_after.append(time.monotonic() - opened)
            sock.close()
        assert thread.is_alive()  # each was closed by the driver, not by the run's end
    finally:
        release.touch()
        thread.join(60)
    # each after the timeout, and all 48 in three turns of it (with margin for a loaded machine)
    assert 1.0 <= min(closed_after) and max(closed_after) < 3 * 1.0 + 10, closed_after
    assert sum("did not prove this run's secret in time" in r.getMessage() for r in caplog.records) == 3 * 16
    assert outcome["v"] == 1
    assert "16 connections are proving the secret at once, the most the driver channel serves" in caplog.text


def put(address: tuple[str, int], body: bytes, source: str = "127.0.0.1") -> int:
    sock = socket.create_connection(address, source_address=(source, 0))
    try:
        sock.sendall(b"PUT /global/key HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        reply = sock.recv(200)
        return int(reply.split()[1]) if reply else 0
    finally:
        sock.close()


def test_the_rendezvous_serves_only_this_runs_hosts_within_bounds(monkeypatch):
    monkeypatch.setattr(gloo_rendezvous, "REQUEST_TIMEOUT_S", 1.0)
    server = gloo_rendezvous.Rendezvous("127.0.0.1")
    server.init(plan_by_node(["127.0.0.1"], cross="local_rank"), hosts=["127.0.0.1"])
    address = ("127.0.0.1", server.port)
    try:
        assert put(address, b"value") == 200
        assert put(address, b"value", source="127.0.0.2") == 0  # not a host of this run: closed unanswered
        assert put(address, b"x" * (gloo_rendezvous.MAX_BODY_BYTES + 1)) == 413
        slow = socket.create_connection(address)
        slow.sendall(b"PUT /global/key HTTP/1.1\r\n")  # and then nothing
        slow.settimeout(10)
        started = time.monotonic()
        assert slow.recv(100) == b""
        assert time.monotonic() - started < 5
        slow.close()
    finally:
        server.stop()


def test_log_callback_shows_metrics_that_are_not_scalars(capsys):
    import numpy as np

    from airflow_provider_hvd.horovod.keras import LogCallback

    callback = LogCallback()
    callback.set_params({"epochs": 2})
    callback.on_epoch_end(0, {"loss": 0.25, "confusion": np.array([[3, 1], [0, 4]]), "tag": "best"})
    assert capsys.readouterr().out == "epoch 1/2 end: loss=0.25 confusion=[[3, 1], [0, 4]] tag=best\n"


@pytest.mark.parametrize(
    ("master", "local"),
    [
        ("local", True),
        ("local[4]", True),
        ("local[*]", True),
        ("local[4,2]", True),
        ("local[*,3]", True),
        ("local-cluster[2,1,1024]", False),
        ("localhost", False),
        ("spark://local:7077", False),
        ("yarn", False),
    ],
)
def test_which_masters_are_local(master, local):
    assert is_local(master) is local
