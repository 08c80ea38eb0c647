"""Where the driver listens for its agents (the channel) and ranks (Gloo's rendezvous), and what it tells them.

On a cluster the two may differ, as they do for Spark's own driver: the channel and the rendezvous listen on
``spark.driver.bindAddress`` (when set) and the agents and ranks are told ``spark.driver.host``, e.g. a
driver in a container whose ports are published on its host. Their ports are any free ones unless
``spark.horovodRunner.channelPort`` / ``spark.horovodRunner.rendezvousPort`` fix them (so that they can be
published); a fixed port is this run's alone while it lasts. Over Spark Connect the agents reach the client,
not the server's driver: ``spark.horovodRunner.driverHost`` / ``driverBindAddress`` replace ``spark.driver.*``.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import LaunchError
from ..shared.naming import HOROVOD_RUNNER, TORCH_DISTRIBUTOR, RunnerNaming

LOOPBACK = "127.0.0.1"
CHANNEL_PORT_CONF = "spark.horovodRunner.channelPort"
RENDEZVOUS_PORT_CONF = "spark.horovodRunner.rendezvousPort"
BIND_ADDRESS_CONF = "spark.driver.bindAddress"
HOST_CONF = "spark.driver.host"
# over Spark Connect, spark.driver.* are the server's: these say what the agents are told, and where to listen
CONNECT_HOST_CONF = "spark.horovodRunner.driverHost"
CONNECT_BIND_CONF = "spark.horovodRunner.driverBindAddress"
_MAX_PORT = 65535

T = TypeVar("T")


@dataclass(frozen=True)
class Listener:
    """One of the driver's two listeners: what it is, and the setting that fixes its port."""

    what: str
    port_setting: str


CHANNEL = Listener("driver channel", CHANNEL_PORT_CONF)
RENDEZVOUS = Listener(HOROVOD_RUNNER.rendezvous, RENDEZVOUS_PORT_CONF)
STORE = Listener(TORCH_DISTRIBUTOR.rendezvous, RENDEZVOUS_PORT_CONF)  # torch.distributed's, at the same port setting


@dataclass(frozen=True)
class DriverAddress:
    """``advertised``: the host the agents and ranks connect to; ``bind``: the address the driver listens on."""

    advertised: str
    bind: str
    channel_port: int = 0  # 0: any free port
    rendezvous_port: int = 0
    address_settings: str = ""  # the settings ``bind`` comes from, named in errors ("" for the fixed loopback)
    naming: RunnerNaming = HOROVOD_RUNNER  # the runner whose run listens, as its errors name it

    def port_of(self, listener: Listener) -> int:
        return self.channel_port if listener is CHANNEL else self.rendezvous_port

    def listen(self, listener: Listener, open_: Callable[[str, int], T]) -> T:
        """``open_(bind, port)``, its socket error turned into a LaunchError that names the setting to change."""
        port = self.port_of(listener)
        try:
            return open_(self.bind, port)
        except OSError as exc:
            where = f"{self.naming.runner} cannot listen for its {listener.what} on {self.bind}:{port}"
            setting = f"{listener.port_setting}={port}"
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(
                    f"{where} ({setting}): the port is in use, by another process or by another "
                    f"{self.naming.runner} run (a fixed port serves one run at a time). Free it, choose another "
                    f"port, or set {listener.port_setting}=0 (any free port)."
                ) from exc
            settings = ", ".join(filter(None, [self.address_settings, setting if port else ""]))
            raise LaunchError(
                where
                + (f" ({settings})" if settings else "")
                + f": {exc.strerror or exc}. Listen on an address of this host ({BIND_ADDRESS_CONF}), on a port "
                "this user may open."
            ) from exc

    def describe(self, port: int) -> str:
        """``host:port`` as the agents and ranks are told, and where the driver listens when that differs."""
        told = f"{self.advertised}:{port}"
        return told if self.bind == self.advertised else f"{told} (listening on {self.bind}:{port})"


LOOPBACK_DRIVER = DriverAddress(LOOPBACK, LOOPBACK)


def parse_port(conf: Callable[[str], str | None], setting: str) -> int:
    """The port ``setting`` asks for: an int in 0..65535, 0 (the default) meaning any free port."""
    value = conf(setting)
    if value is None or not value.strip():
        return 0
    try:
        port = int(value.strip())
    except ValueError:
        port = -1
    if not 0 <= port <= _MAX_PORT:
        raise LaunchError(
            f"{setting}={value!r} is not a port: give an int from 1 to {_MAX_PORT}, or 0 (the default) for any "
            "free port."
        )
    return port


def _ports(conf: Callable[[str], str | None], naming: RunnerNaming) -> tuple[int, int]:
    channel, rendezvous = parse_port(conf, CHANNEL_PORT_CONF), parse_port(conf, RENDEZVOUS_PORT_CONF)
    if channel and channel == rendezvous:
        raise LaunchError(
            f"{CHANNEL_PORT_CONF} and {RENDEZVOUS_PORT_CONF} are both {channel}: the driver channel and the "
            f"{naming.rendezvous} need a port each."
        )
    return channel, rendezvous


def route_address(host: str, naming: RunnerNaming = HOROVOD_RUNNER) -> str:
    """This host's address on its route to ``host`` (no packet is sent: a UDP socket's connect picks the route)."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(target)
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise LaunchError(
            f"{naming.runner} cannot tell this host's address on its route to the Spark Connect server {host} "
            f"({exc}): set {CONNECT_HOST_CONF} to the address the server's executors reach this host at."
        ) from exc


def connect_driver_address(
    conf: Callable[[str], str | None], server_host: str, local: bool, naming: RunnerNaming = HOROVOD_RUNNER
) -> DriverAddress:
    """The driver's address over Spark Connect: the agents reach this process, the client, not the server's
    driver.

    ``spark.horovodRunner.driverHost`` (else this host's address on its route to the server) is what the agents
    are told, ``spark.horovodRunner.driverBindAddress`` (else that address) where the driver listens. A server
    reached over loopback runs on this host: its executors on a local master reach loopback, those of a cluster
    the address its own driver gave them (``spark.driver.host``, an address of this host).
    """
    channel, rendezvous = _ports(conf, naming)
    host, bind = conf(CONNECT_HOST_CONF), conf(CONNECT_BIND_CONF)
    if not host:
        host = route_address(server_host, naming)
        if ipaddress.ip_address(host.split("%")[0]).is_loopback and not local:
            host = conf(HOST_CONF) or socket.gethostname()
        settings = f"{CONNECT_BIND_CONF}={bind}" if bind else f"this host's address on its route to {server_host}"
    else:
        settings = f"{CONNECT_BIND_CONF}={bind}" if bind else f"{CONNECT_HOST_CONF}={host}"
    return DriverAddress(host, bind or host, channel, rendezvous, settings, naming)


def spark_driver_address(
    conf: Callable[[str], str | None], local: bool, naming: RunnerNaming = HOROVOD_RUNNER
) -> DriverAddress:
    """The driver's address from the Spark conf (``conf(key)`` is the value or None).

    On a local master the executors are on this host: the driver listens on loopback, whatever
    ``spark.driver.host`` (Spark sets it to a network address of this host) and ``spark.driver.bindAddress``.
    """
    channel, rendezvous = _ports(conf, naming)
    if local:
        return DriverAddress(LOOPBACK, LOOPBACK, channel, rendezvous, naming=naming)
    host = conf(HOST_CONF) or socket.gethostname()
    bind = conf(BIND_ADDRESS_CONF)
    settings = f"{BIND_ADDRESS_CONF}={bind}" if bind else f"{HOST_CONF}={host}"
    return DriverAddress(host, bind or host, channel, rendezvous, settings, naming)
