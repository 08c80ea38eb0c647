"""The driver behind published ports: fixed ports for HorovodRunner's channel and rendezvous, ``spark.driver.host``
advertised to the executors and ranks while the driver listens on ``spark.driver.bindAddress``.

As in a container whose ports are published: the driver listens on 127.0.0.1, everything it tells the
executors and ranks says 127.0.0.2, and a forwarder (the container engine's part) relays 127.0.0.2:port to
127.0.0.1:port, from 127.0.0.3 (so the driver sees its peers at another address than their own, as behind a
NAT). Spark's own driver ports go the same way. A real standalone cluster on loopback.
"""

from __future__ import annotations

import collections
import errno
import os
import socket
import threading
import time

import pytest
from conftest import make_session
from jobs import sleep_and_record, wait_for_pids
from spark_cluster import free_port

from airflow_provider_hvd import HorovodRunner, LaunchError
from airflow_provider_hvd.runner.driver.launch.address import (
    CHANNEL,
    CHANNEL_PORT_CONF,
    LOOPBACK,
    RENDEZVOUS_PORT_CONF,
    spark_driver_address,
)
from airflow_provider_hvd.runner.driver.watch.channel import DriverChannel

ADVERTISED, NAT = "127.0.0.2", "127.0.0.3"


class PortForwarder:
    """Relays connections to ``public``:port to ``private``:port for each of ``ports``, connecting from ``source``."""

    def __init__(self, public: str, private: str, source: str, ports: list[int]) -> None:
        self.private, self.source = private, source
        self.connections: collections.Counter[int] = collections.Counter()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._servers = [socket.create_server((public, port)) for port in ports]
        for server, port in zip(self._servers, ports, strict=False):
            server.settimeout(0.2)
            threading.Thread(target=self._accept, args=(server, port), daemon=True).start()

    def _accept(self, server: socket.socket, port: int) -> None:
        while not self._closed:
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            self.connections[port] += 1
            try:
                upstream = socket.create_connection((self.private, port), source_address=(self.source, 0))
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()
        server.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in (src, dst):
                sock.close()

    def close(self) -> None:
        self._closed = True
        for sock in self._sockets:
            sock.close()


PORTS = {name: free_port() for name in ("driver", "block_manager", "channel", "rendezvous")}


@pytest.fixture(scope="module")
def published():
    forwarder = PortForwarder(ADVERTISED, LOOPBACK, NAT, list(PORTS.values()))
    yield forwarder
    forwarder.close()


@pytest.fixture(scope="module")
def spark(standalone_cluster, published):
    session = make_session(
        standalone_cluster.url,
        **{
            **standalone_cluster.app_conf,
            "spark.executor.cores": "1",
            "spark.cores.max": "2",
            "spark.driver.host": ADVERTISED,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.driver.port": str(PORTS["driver"]),
            "spark.driver.blockManager.port": str(PORTS["block_manager"]),
            CHANNEL_PORT_CONF: str(PORTS["channel"]),
            RENDEZVOUS_PORT_CONF: str(PORTS["rendezvous"]),
        },
    )
    yield session
    session.stop()


def jobs_started(spark) -> int:
    sc = spark.sparkContext
    return sc._jsc.sc().statusStore().jobsList(sc._jvm.java.util.ArrayList()).size()


def rendezvous_seen_by_rank() -> dict:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    return {
        "addr": os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
        "port": int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
        "sum": total,
    }


def test_a_run_reaches_the_driver_at_its_advertised_address_and_fixed_ports(spark, published, caplog):
    caplog.set_level("INFO", logger="airflow_provider_hvd.runner")
    before = published.connections.copy()
    seen = HorovodRunner(np=2).run(rendezvous_seen_by_rank)
    assert seen == {"addr": ADVERTISED, "port": PORTS["rendezvous"], "sum": 2.0}
    channel, rendezvous = PORTS["channel"], PORTS["rendezvous"]
    assert f"driver channel on {ADVERTISED}:{channel} (listening on {LOOPBACK}:{channel})" in caplog.text
    assert f"Gloo rendezvous on {ADVERTISED}:{rendezvous} (listening on {LOOPBACK}:{rendezvous})" in caplog.text
    # every agent and every rank came through the published ports, seen by the driver at the NAT's address
    assert published.connections[channel] - before[channel] == 2
    assert published.connections[rendezvous] - before[rendezvous] >= 2


def test_a_second_run_at_once_cannot_have_the_fixed_port(spark, pid_dir):
    first: dict = {}
    thread = threading.Thread(
        target=lambda: first.setdefault("value", HorovodRunner(np=2).run(sleep_and_record, pid_dir=pid_dir, seconds=5))
    )
    thread.start()
    wait_for_pids(pid_dir, 2)
    jobs = jobs_started(spark)
    started = time.monotonic()
    channel = PORTS["channel"]
    with pytest.raises(
        LaunchError,
        match=rf"on {LOOPBACK}:{channel} \({CHANNEL_PORT_CONF}={channel}\): the port is "
        "in use, by another process or by another HorovodRunner run",
    ):
        HorovodRunner(np=2, slot_wait_timeout=60).run(sleep_and_record, pid_dir=pid_dir)  # not after a wait for slots
    assert time.monotonic() - started < 10
    assert jobs_started(spark) == jobs
    thread.join(60)
    assert first == {"value": None}  # the first run went on undisturbed


def test_a_taken_rendezvous_port_fails_before_any_spark_job(spark):
    jobs = jobs_started(spark)
    with socket.create_server((LOOPBACK, PORTS["rendezvous"])):
        with pytest.raises(LaunchError, match=rf"{RENDEZVOUS_PORT_CONF}={PORTS['rendezvous']}\): the port is in use"):
            HorovodRunner(np=2).run(rendezvous_seen_by_rank)
    assert jobs_started(spark) == jobs
    with socket.create_server((LOOPBACK, PORTS["channel"])):  # the channel's port was let go
        pass


@pytest.mark.parametrize("value", ["http", "-1", "65536", "5000.0", "true"])
def test_a_port_setting_that_is_not_a_port_is_refused(value):
    with pytest.raises(LaunchError, match=rf"{RENDEZVOUS_PORT_CONF}='{value}' is not a port: give an int from 1"):
        spark_driver_address({RENDEZVOUS_PORT_CONF: value}.get, local=False)


def test_the_two_fixed_ports_must_differ():
    with pytest.raises(LaunchError, match="are both 7100: the driver channel and the Gloo rendezvous need a port each"):
        spark_driver_address({CHANNEL_PORT_CONF: "7100", RENDEZVOUS_PORT_CONF: " 7100 "}.get, local=False)


def test_a_local_master_listens_on_loopback_at_the_fixed_ports():
    conf = {
        "spark.driver.host": "10.1.2.3",
        "spark.driver.bindAddress": "0.0.0.0",
        CHANNEL_PORT_CONF: "7100",
        RENDEZVOUS_PORT_CONF: "7101",
    }
    driver = spark_driver_address(conf.get, local=True)
    assert (driver.advertised, driver.bind, driver.channel_port, driver.rendezvous_port) == (
        LOOPBACK,
        LOOPBACK,
        7100,
        7101,
    )
    assert spark_driver_address({}.get, local=False).channel_port == 0  # unset: any free port


def test_a_bind_address_of_another_host_is_named():
    driver = spark_driver_address(
        {"spark.driver.host": "driver.example", "spark.driver.bindAddress": "192.0.2.1"}.get, local=False
    )
    with pytest.raises(LaunchError, match=r"on 192\.0\.2\.1:0 \(spark\.driver\.bindAddress=192\.0\.2\.1\): ") as info:
        driver.listen(CHANNEL, lambda host, port: DriverChannel(host, b"s" * 32, port=port))
    assert info.value.__cause__.errno == errno.EADDRNOTAVAIL
