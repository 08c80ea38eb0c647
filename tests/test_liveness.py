"""Heartbeats on the driver <-> agent channel, on loopback: a silent agent is named by the driver, an agent whose
driver went silent ends its rank, and the settings are checked. (The same on real hosts whose links are cut:
test_hosts.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from jobs import alive, assert_all_gone, sleep_and_record, wait_for_pids

from airflow_provider_hvd import HorovodRunner, LaunchError, RankFailedError
from airflow_provider_hvd.runner.agent.agent import AgentArgs, run_agent
from airflow_provider_hvd.runner.driver.events import HostLost
from airflow_provider_hvd.runner.driver.verdict.outcome import SETTLE_S, RunOutcome
from airflow_provider_hvd.runner.driver.verdict.report import abort_reason, run_error
from airflow_provider_hvd.runner.driver.watch.channel import DriverChannel
from airflow_provider_hvd.runner.shared.liveness import Liveness, liveness_settings
from airflow_provider_hvd.runner.shared.messages import (
    AgentAlive,
    DriverAlive,
    Hello,
    Start,
    decode,
    frame,
)
from airflow_provider_hvd.runner.shared.payload import dumps_job
from airflow_provider_hvd.runner.shared.wire import (
    NONCE_BYTES,
    PROOF_BYTES,
    DriverHandshake,
    FrameDecoder,
    agent_answer,
    new_secret,
)

FAST = Liveness(interval_s=0.2, timeout_s=1.0)


def test_settings_come_from_the_runner_then_the_spark_conf_then_the_defaults():
    conf = {"spark.horovodRunner.heartbeatInterval": "500ms", "spark.horovodRunner.heartbeatTimeout": "4s"}
    assert liveness_settings(lambda key: None) == Liveness(2.0, 10.0)
    assert liveness_settings(conf.get) == Liveness(0.5, 4.0)
    assert liveness_settings(conf.get, interval_s=1, timeout_s=6) == Liveness(1.0, 6.0)
    assert liveness_settings({"spark.horovodRunner.heartbeatTimeout": "1min"}.get) == Liveness(2.0, 60.0)
    with pytest.raises(LaunchError, match=r"spark.horovodRunner.heartbeatTimeout='soon' is not a duration"):
        liveness_settings({"spark.horovodRunner.heartbeatTimeout": "soon"}.get)
    with pytest.raises(LaunchError, match=r"heartbeat timeout \(3s.*at least 3 heartbeat intervals \(2s"):
        liveness_settings(lambda key: None, timeout_s=3)
    with pytest.raises(ValueError, match=r"heartbeat_interval_s must be a number of seconds > 0, not -1"):
        liveness_settings(lambda key: None, interval_s=-1)


def test_a_bad_setting_fails_the_run_before_anything_starts():
    runner = HorovodRunner(np=-1)
    runner.heartbeat_timeout_s = 1.0  # fewer than 3 of the default 2 s intervals
    with pytest.raises(LaunchError, match="at least 3 heartbeat intervals"):
        runner.run(print)


def test_a_host_lost_names_its_ranks_its_name_and_address():
    outcome = RunOutcome(4)
    outcome.started()
    lost = HostLost((2, 3), "10.1.2.3", "host-1", "for 11s (heartbeat timeout 10s): the host is down")
    assert outcome.record(lost, now=0.0) is None  # a failure: the reports racing it are awaited
    cause = outcome.due(now=SETTLE_S)
    assert abort_reason(cause) == "the host host-1 (10.1.2.3) of ranks 2 and 3 was lost"
    error = run_error(outcome)
    assert isinstance(error, RankFailedError) and error.rank == 2
    assert str(error) == (
        "Horovod ranks 2 and 3 of 4 failed: their host host-1 (10.1.2.3) was lost: nothing heard from any of their "
        "agents for 11s (heartbeat timeout 10s): the host is down"
    )


def _agent_connection(channel: DriverChannel, secret: bytes) -> socket.socket:
    """A connection that proves the secret and says hello, as an agent does."""
    sock = socket.create_connection((channel.host, channel.port), timeout=10)
    answer, driver_proof = agent_answer(secret, _read(sock, NONCE_BYTES))
    sock.sendall(answer)
    assert _read(sock, PROOF_BYTES) == driver_proof
    sock.sendall(frame(Hello(host="127.0.0.1", pid=os.getpid())))
    return sock


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed"
        data += chunk
    return data


def test_the_driver_ends_a_silent_agents_link_and_keeps_a_beating_one():
    secret = new_secret()
    channel = DriverChannel("127.0.0.1", secret, liveness=FAST)
    stop = threading.Event()
    received: list[object] = []
    try:
        silent, beating = _agent_connection(channel, secret), _agent_connection(channel, secret)

        def beat() -> None:
            decoder = FrameDecoder()
            beating.settimeout(0.05)
            while not stop.is_set():
                beating.sendall(frame(AgentAlive()))
                try:
                    received.extend(decode(kind, body) for kind, body in decoder.feed(beating.recv(1 << 16)))
                except TimeoutError:
                    pass
                stop.wait(FAST.interval_s)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        hellos = [channel.events.get(timeout=10) for _ in range(2)]
        said_hello = time.monotonic()
        assert all(isinstance(event.message, Hello) for event in hellos)
        lost = channel.events.get(timeout=10)
        named_after = time.monotonic() - said_hello
        assert lost.message is None and lost.silent_for is not None and lost.silent_for > FAST.timeout_s
        assert lost.conn.sock.fileno() == -1 and "nothing heard from it for" in lost.lost
        assert named_after < FAST.timeout_s + 3  # the bound is the feature: timeout plus an interval, and margin
        beats_wanted = 4 * round(FAST.timeout_s / FAST.interval_s)  # the beating link outlives several timeouts
        deadline = time.monotonic() + 30
        while sum(isinstance(m, DriverAlive) for m in received) < beats_wanted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(isinstance(m, DriverAlive) for m in received) >= beats_wanted
        assert channel.events.empty(), channel.events.get()
        silent.settimeout(5)
        assert silent.recv(1 << 16).startswith(frame(DriverAlive()))  # it was sent beats, then closed
    finally:
        stop.set()
        channel.close()


def record_pid_and_sleep(pid_dir: str) -> None:
    Path(pid_dir, "rank-0.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_an_agent_whose_driver_goes_silent_ends_its_rank(pid_dir):
    """A driver that said Start and then nothing (its host vanished): the agent ends the rank after the timeout."""
    secret = new_secret()
    listener = socket.create_server(("127.0.0.1", 0))
    args = AgentArgs(
        "127.0.0.1", listener.getsockname()[1], secret, relay_output=False, echo_output=False, liveness=FAST
    )
    job = dumps_job(record_pid_and_sleep, (), {"pid_dir": pid_dir})
    outcome: dict[str, str] = {}
    agent = threading.Thread(target=lambda: outcome.update(result=run_agent(args, lambda: job)), daemon=True)
    agent.start()
    conn, _ = listener.accept()
    with conn:
        handshake = DriverHandshake(secret)
        conn.sendall(handshake.nonce)
        conn.sendall(handshake.verify(_read(conn, DriverHandshake.ANSWER_BYTES)))
        decoder, messages = FrameDecoder(), []
        while not messages:
            messages = [decode(kind, body) for kind, body in decoder.feed(conn.recv(1 << 16))]
        assert isinstance(messages[0], Hello)
        conn.sendall(frame(Start(0, "Horovod", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}, 1)))
        started = threading.Event()

        def beat_until_started() -> None:  # a live driver while the rank starts
            while not started.wait(FAST.interval_s):
                conn.sendall(frame(DriverAlive()))

        beating = threading.Thread(target=beat_until_started, daemon=True)
        beating.start()
        try:
            rank = wait_for_pids(pid_dir, 1, timeout=60)[0]
        finally:
            started.set()
            beating.join()
        silent_since = time.monotonic()  # from here on the driver says nothing, and its connection stays open
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            psutil.Process(rank).wait(FAST.timeout_s + 10)  # the timeout, then the rank's SIGTERM
        ended_after = time.monotonic() - silent_since
        agent.join(15)
        assert not agent.is_alive() and not alive(rank)
        # the rank (asleep for 600s) was ended by its agent, for the driver's silence: not before the timeout (less
        # the interval since the driver's last beat), and soon after it
        assert FAST.timeout_s - FAST.interval_s <= ended_after < FAST.timeout_s + 10, ended_after
        assert outcome["result"] == "lost the driver"  # "done" would be a rank that ended and was reported
        beats = []
        conn.settimeout(1)
        try:
            while data := conn.recv(1 << 16):
                beats.extend(decode(kind, body) for kind, body in decoder.feed(data))
        except TimeoutError:
            pass
        assert sum(isinstance(message, AgentAlive) for message in beats) >= 3  # it said it was alive meanwhile
    listener.close()


def test_a_hung_agent_is_named_within_the_timeout(spark_local, pid_dir):
    """SIGSTOP an agent (its rank goes on): nothing comes from it, and the driver names its rank and agent."""
    runner = HorovodRunner(np=2)
    runner.heartbeat_interval_s, runner.heartbeat_timeout_s = 0.5, 3.0
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.update(
            error=pytest.raises(RankFailedError, runner.run, sleep_and_record, pid_dir=pid_dir)
        )
    )
    thread.start()
    pids = wait_for_pids(pid_dir, 2)
    agent = psutil.Process(int(Path(pid_dir, "rank-1.pid").read_text())).parent().parent()
    agent.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        thread.join(60)
        named_after = time.monotonic() - stopped
    finally:
        agent.send_signal(signal.SIGCONT) if agent.is_running() else None
    assert not thread.is_alive()
    error = outcome["error"].value
    assert error.rank == 1, str(error)
    assert "Horovod rank 1 of 2 failed: its agent in Spark task 1" in str(error)
    assert "nothing heard from it for" in str(error), str(error)
    assert named_after < 3.0 + 15  # the timeout, and the other rank's end (its SIGTERM grace)
    assert_all_gone(pids, within=20)
