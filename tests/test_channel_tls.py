"""The driver channel is TLS when the application has Spark encrypt its traffic: a real encrypted Spark run, the
channel's bytes read on the wire (by a recording proxy between the agents and the driver), an impostor's
certificate refused, and the WARNING about Gloo."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable

import psutil
import pytest
from conftest import make_session
from rank_lines import lines_by_rank

from airflow_provider_hvd import HorovodRunner, LaunchError
from airflow_provider_hvd.runner.agent.agent import AgentArgs
from airflow_provider_hvd.runner.driver.launch.local import LocalLauncher
from airflow_provider_hvd.runner.driver.launch.spark import encryption
from airflow_provider_hvd.runner.driver.watch.channel import DriverChannel
from airflow_provider_hvd.runner.driver.watch.supervisor import Supervisor
from airflow_provider_hvd.runner.shared.liveness import Liveness
from airflow_provider_hvd.runner.shared.payload import dumps_job
from airflow_provider_hvd.runner.shared.tls import RunCertificate
from airflow_provider_hvd.runner.shared.wire import DriverHandshake, new_secret

MARKER = "wire-marker-5c1f9e"
FLOOD_LINES = 3000
BIG_RESULT_BYTES = 4 << 20
SPARK_ENCRYPTS = {
    "spark.authenticate": "true",
    "spark.authenticate.secret": "hvd-tests-secret",  # (a local master would make one; set as on a cluster)
    "spark.network.crypto.enabled": "true",
}


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")


@pytest.fixture
def fresh_warning(monkeypatch):
    """The once-per-process WARNING, as in a fresh driver process."""
    monkeypatch.setattr(encryption, "_warned", set())


def allreduce_and_talk(marker: str, flood: int = 0, big: int = 0) -> dict:
    """A real allreduce; a log_to_driver line and the result carry ``marker``; ``flood`` lines of output, and a
    result of ``big`` bytes more."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_hvd import log_to_driver

    hvd.init()
    for i in range(flood):
        print(f"flood {hvd.rank()}.{i}")
    log_to_driver(f"{marker} from rank {hvd.rank()}")
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    return {"sum": total, "marker": marker, "big": os.urandom(big // 2).hex()}


def relayed(caplog, rank: int) -> list[str]:
    return lines_by_rank(caplog.records).get(rank, [])


# --- a real run on Spark with encryption on --------------------------------------------------------------


@pytest.fixture(scope="module")
def spark_encrypted():
    spark = make_session("local[2]", **SPARK_ENCRYPTS)
    yield spark
    spark.stop()


def runner_warnings(caplog) -> list[str]:
    """The runner's warnings (another library's, such as a lingering MLflow client's retries, are not its)."""
    ours = [r for r in caplog.records if r.name.startswith("airflow_provider_hvd")]
    return [r.getMessage() for r in ours if r.levelno == logging.WARNING]


def test_a_spark_run_that_encrypts_has_a_tls_channel_and_warns_once_about_gloo(spark_encrypted, caplog, fresh_warning):
    assert spark_encrypted.sparkContext.getConf().get("spark.network.crypto.enabled") == "true"
    result = HorovodRunner(np=2).run(allreduce_and_talk, marker=MARKER)
    assert result["sum"] == 3.0 and result["marker"] == MARKER
    assert relayed(caplog, 0) == [f"{MARKER} from rank 0"] and relayed(caplog, 1) == [f"{MARKER} from rank 1"]
    channel = [r.getMessage() for r in caplog.records if "driver channel on" in r.getMessage()]
    assert len(channel) == 1 and re.search(r"TLS 1\.3 \(this run's certificate, SHA-256 [0-9a-f]{64}\)", channel[0])
    warnings = runner_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "spark.network.crypto.enabled=true" in warnings[0]
    assert "the driver channel (TLS" in warnings[0]
    assert "Gloo traffic between the ranks (the tensors, and its rendezvous) cannot be encrypted" in warnings[0]


def test_a_torch_distributed_run_that_encrypts_has_a_tls_channel_and_says_what_torch_cannot_encrypt(
    spark_encrypted, caplog, fresh_warning
):
    import torch_jobs

    from airflow_provider_hvd import TorchDistributor

    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_jobs.train_ddp, steps=2)
    assert len(result["views"]) == 2
    channel = [r.getMessage() for r in caplog.records if "driver channel on" in r.getMessage()]
    assert len(channel) == 1 and "TLS 1.3 (this run's certificate" in channel[0]
    warnings = runner_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("TorchDistributor: spark.network.crypto.enabled=true")
    assert "torch.distributed's traffic between the ranks (Gloo's or NCCL's tensors, and its store" in warnings[0]


def test_the_warning_comes_once_per_process_and_only_when_spark_encrypts(caplog, fresh_warning):
    from airflow_provider_hvd.runner.driver.ranks.horovod import HorovodKind

    encryption.warn_if_spark_encrypted({"spark.network.crypto.enabled": "false"}.get)
    assert not caplog.records
    for _ in range(2):
        encryption.warn_if_spark_encrypted({"spark.ssl.enabled": "true"}.get, "HorovodRunner", HorovodKind.unencrypted)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "spark.ssl.enabled=true: Spark's traffic is encrypted, and so is the driver channel" in caplog.text
    assert "Gloo traffic between the ranks" in caplog.text and "travels unencrypted" in caplog.text


# --- the bytes on the wire -------------------------------------------------------------------------------


class RecordingProxy:
    """Forwards each connection to ``target`` and keeps every byte that passed, both ways."""

    def __init__(self, target: tuple[str, int], up_bytes_per_s: float | None = None) -> None:
        self.target = target
        self.up_bytes_per_s = up_bytes_per_s  # a slow link from the agents to the driver
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.to_driver: list[bytearray] = []  # per connection, in the order they came
        self.to_agent: list[bytearray] = []
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                agent, _ = self.listener.accept()
            except OSError:
                return
            driver = socket.create_connection(self.target)
            self._socks += [agent, driver]
            for target, args in self._forwarders(agent, driver):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _forwarders(self, agent: socket.socket, driver: socket.socket) -> list[tuple[Callable[..., None], tuple]]:
        """The threads that carry one connection: each direction pumped, and recorded."""
        up, down = bytearray(), bytearray()
        self.to_driver.append(up)
        self.to_agent.append(down)
        return [(self._pump, (agent, driver, up, self.up_bytes_per_s)), (self._pump, (driver, agent, down, None))]

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray, rate: float | None) -> None:
        try:
            while data := src.recv(1 << 16):
                record += data
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)  # the link's pace (not a wait for a state)
            dst.shutdown(socket.SHUT_WR)  # as TCP would: the other direction goes on until its own end
        except OSError:
            RecordingProxy.reset(src, dst)

    @staticmethod
    def reset(*socks: socket.socket) -> None:
        """A reset on the way: both ends learn of it."""
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def everything(self) -> bytes:
        return b"".join(bytes(b) for b in (*self.to_driver, *self.to_agent))

    def close(self) -> None:
        self.listener.close()
        self._accepting.join(10)
        for thread in self._threads:
            thread.join(10)
        for sock in self._socks:
            sock.close()


class ProxiedLauncher(LocalLauncher):
    """Local ranks whose agents reach the driver channel through a :class:`RecordingProxy`."""

    proxy: RecordingProxy | None = None
    up_bytes_per_s: float | None = None

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        self.proxy = RecordingProxy((host, port), self.up_bytes_per_s)
        return dataclasses.replace(super().agent_args(host, port, secret, verbosity), port=self.proxy.port)


def run_supervised(launcher: LocalLauncher, tls: bool, liveness: Liveness | None = None, **kwargs) -> object:
    """What HorovodRunner.run does, with ``launcher`` (TLS is decided by the Spark conf there; here by ``tls``)."""
    payload = dumps_job(allreduce_and_talk, (), {"marker": MARKER, **kwargs})
    return Supervisor(launcher, payload, "all", lambda: False, 120.0, liveness=liveness, channel_tls=tls).run()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_the_channels_bytes_are_encrypted_when_tls_is_on(tls, caplog):
    launcher = ProxiedLauncher(2)
    try:
        result = run_supervised(launcher, tls, flood=FLOOD_LINES, big=BIG_RESULT_BYTES)
    finally:
        if launcher.proxy is not None:
            launcher.proxy.close()
    assert isinstance(result, dict) and result["sum"] == 3.0 and len(result["big"]) == BIG_RESULT_BYTES
    for rank in (0, 1):  # a log flood and a log_to_driver line came through, in order and whole
        lines = relayed(caplog, rank)
        assert [line for line in lines if line.startswith("flood")] == [f"flood {rank}.{i}" for i in range(FLOOD_LINES)]
        assert f"{MARKER} from rank {rank}" in lines
    proxy = launcher.proxy
    assert proxy is not None and len(proxy.to_driver) == 2  # both agents went through the proxy
    wire = proxy.everything()
    assert len(wire) > BIG_RESULT_BYTES  # rank 0's result crossed it
    if tls:
        assert MARKER.encode() not in wire and b"flood 0.1" not in wire
        assert result["big"][:64].encode() not in wire
        assert all(up.startswith(b"\x16\x03") for up in proxy.to_driver)  # each began with a TLS ClientHello
    else:
        assert MARKER.encode() in wire and b"flood 0.1" in wire  # the same run in the clear: the test can fail


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_large_result_on_a_slow_link_reaches_the_driver(tls):
    """Rank 0's result is still on its way when its agent is done: heartbeats from the driver that come after
    the agent's end must not reset the connection (and drop what is still queued)."""
    launcher = ProxiedLauncher(2)
    launcher.up_bytes_per_s = 2 << 20  # 2 MiB/s: the last MiBs of the result are queued when the agent ends
    try:
        result = run_supervised(launcher, tls, Liveness(interval_s=0.1, timeout_s=5.0), big=BIG_RESULT_BYTES)
    finally:
        if launcher.proxy is not None:
            launcher.proxy.close()
    assert isinstance(result, dict) and len(result["big"]) == BIG_RESULT_BYTES


# --- an impostor's certificate ----------------------------------------------------------------------------


class Impostor:
    """A TLS server with a certificate of its own where the agents are told the driver is (an interceptor)."""

    def __init__(self) -> None:
        self.certificate = RunCertificate.new()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received: list[bytes] = []  # what each agent sent inside TLS
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            raw.settimeout(30)
            got = b""
            try:
                with self.certificate.context.wrap_socket(raw, server_side=True) as conn:
                    conn.sendall(os.urandom(32))  # a nonce, as the driver would send
                    while data := conn.recv(1 << 16):
                        got += data
            except (OSError, ssl.SSLError):
                pass  # the agent hung up
            self.received.append(got)

    def close(self) -> None:
        self.listener.close()
        self._thread.join(10)


class ImpostorLauncher(LocalLauncher):
    impostor: Impostor | None = None

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        self.impostor = Impostor()
        return dataclasses.replace(super().agent_args(host, port, secret, verbosity), port=self.impostor.port)


def test_an_agent_refuses_a_certificate_other_than_the_runs_and_the_run_fails_naming_it(caplog):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    launcher = ImpostorLauncher(2)
    try:
        with pytest.raises(LaunchError) as info:
            run_supervised(launcher, tls=True)
        impostor = launcher.impostor
        assert impostor is not None
        deadline = time.monotonic() + 15
        while len(impostor.received) < 2 and time.monotonic() < deadline:  # both agents came, and hung up
            time.sleep(0.05)
    finally:
        if launcher.impostor is not None:
            launcher.impostor.close()
    message = str(info.value)
    assert "the driver channel's TLS certificate is not this run's" in message, message
    assert f"its SHA-256 fingerprint is {impostor.certificate.fingerprint}" in message, message
    run_fingerprint = re.search(r"SHA-256 ([0-9a-f]{64})\)", caplog.text)
    assert run_fingerprint and f"the run's is {run_fingerprint[1]}" in message, message
    assert impostor.received == [b"", b""]  # neither agent sent it anything: no proof of the secret, no hello
    assert "ranks started" not in caplog.text
    deadline = time.monotonic() + 15
    while (left := {p.pid for p in me.children(recursive=True)} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [psutil.Process(pid).cmdline() for pid in left if psutil.pid_exists(pid)]


def test_a_connection_that_does_not_speak_tls_to_a_tls_channel_is_rejected(caplog):
    """Bytes in the clear (a port scanner, an agent of another run) get nothing back, not even the nonce."""
    channel = DriverChannel("127.0.0.1", new_secret(), tls=RunCertificate.new().context)
    try:
        with socket.create_connection((channel.host, channel.port), timeout=10) as sock:
            sock.sendall(b"hello in the clear".ljust(DriverHandshake.ANSWER_BYTES))  # an answer's worth of bytes
            assert sock.recv(1 << 16) == b""  # closed, without a byte sent
        deadline = time.monotonic() + 10
        while "rejected a connection" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert re.search(r"rejected a connection from 127\.0\.0\.1:\d+ to the driver channel: .*SSL", caplog.text)
        assert channel.events.empty()
    finally:
        channel.close()
