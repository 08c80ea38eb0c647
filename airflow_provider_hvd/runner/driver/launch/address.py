"""Where the driver listens for its agents (the channel) and ranks (Gloo's rendezvous), and what it tells them.

On a cluster the two may differ, as they do for Spark's own driver: the channel and the rendezvous listen on
``spark.driver.bindAddress`` (when set) and the agents and ranks are told ``spark.driver.host``, e.g. a
driver in a container whose ports are published on its host. Their ports are any free ones unless
``spark.horovodRunner.channelPort`` / ``spark.horovodRunner.rendezvousPort`` fix them (so that they can be
published); a fixed port is this run's alone while it lasts. Over Spark Connect the agents reach the client,
not the server's driver: ``spark.horovodRunner.driverHost`` / ``driverBindAddress`` replace ``spark.driver.*``.

IPv6 as IPv4: each listener takes its address's family (``::1``, ``fe80::1%eth0``; a name: IPv4 where it has
an IPv4 address, else IPv6), so that ``localhost`` works where it is ``::1`` first.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ...errors import JobRefusedError, LaunchError
from ...shared.naming import HOROVOD_RUNNER, TORCH_DISTRIBUTOR, RunnerNaming

LOOPBACK = "127.0.0.1"
CHANNEL_PORT_CONF = "spark.horovodRunner.channelPort"
RENDEZVOUS_PORT_CONF = "spark.horovodRunner.rendezvousPort"
BIND_ADDRESS_CONF = "spark.driver.bindAddress"
HOST_CONF = "spark.driver.host"
# over Spark Connect, spark.driver.* are the server's: these say what the agents are told, and where to listen
CONNECT_HOST_CONF = "spark.horovodRunner.driverHost"
CONNECT_BIND_CONF = "spark.horovodRunner.driverBindAddress"
#: over Spark Connect, the settings of the client's own address (what its agents are told, where it listens, its
#: fixed ports: a client in a container sets them): a submitted run's host, on an executor, is not that client
#: and never takes them (durable/submit.py); tests/test_durable_runs.py holds this to what the code here reads
CLIENT_ADDRESS_SETTINGS = (CONNECT_HOST_CONF, CONNECT_BIND_CONF, CHANNEL_PORT_CONF, RENDEZVOUS_PORT_CONF)
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
    bind_setting: str = BIND_ADDRESS_CONF  # the settings that say where to listen (others over Spark Connect)
    host_setting: str = HOST_CONF  # the setting that says what the agents are told

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
            raise JobRefusedError(
                where
                + (f" ({settings})" if settings else "")
                + f": {exc.strerror or exc}. Listen on an address of this host ({self.bind_setting}), on a port "
                "this user may open."
            ) from exc

    def describe(self, port: int) -> str:
        """``host:port`` as the agents and ranks are told, and where the driver listens when that differs."""
        told = host_port(self.advertised, port)
        return told if self.bind == self.advertised else f"{told} (listening on {host_port(self.bind, port)})"


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:7000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address_family(host: str) -> socket.AddressFamily:
    """The family to listen on ``host`` with: an address's own; for a name, IPv4 where it has an IPv4 address
    (as before), else IPv6 (a name that is ``::1`` alone). A name that does not resolve: IPv4, whose bind then
    says so."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.split("%")[0]).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        families = {info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return socket.AF_INET
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this host's loopback alone (``0.0.0.0`` is not)."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (0: any free port), IPv4 or IPv6 as ``host`` is."""
    return socket.create_server((host, port), family=address_family(host), backlog=backlog)


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
        raise JobRefusedError(
            f"{setting}={value!r} is not a port: give an int from 1 to {_MAX_PORT}, or 0 (the default) for any "
            "free port."
        )
    return port


def _ports(conf: Callable[[str], str | None], naming: RunnerNaming) -> tuple[int, int]:
    channel, rendezvous = parse_port(conf, CHANNEL_PORT_CONF), parse_port(conf, RENDEZVOUS_PORT_CONF)
    if channel and channel == rendezvous:
        raise JobRefusedError(
            f"{CHANNEL_PORT_CONF} and {RENDEZVOUS_PORT_CONF} are both {channel}: the driver channel and the "
            f"{naming.rendezvous} need a port each."
        )
    return channel, rendezvous


def route_address(host: str, naming: RunnerNaming = HOROVOD_RUNNER) -> str:
    """This host's address on its route to ``host`` (no packet is sent: a UDP socket's connect picks the route).

    IPv4 first where ``host`` has both kinds of address, whatever order the resolver gives (``localhost`` is
    ``::1`` first on many hosts): Horovod's Gloo rendezvous takes IPv4 only; IPv6 where ``host`` has no IPv4
    route."""
    failure: OSError | None = None
    try:
        found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        found, failure = [], exc
    for family, kind, proto, _, target in sorted(found, key=lambda info: info[0] != socket.AF_INET):
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(target)
                return str(sock.getsockname()[0])
        except OSError as exc:
            failure = exc
    raise LaunchError(
        f"{naming.runner} cannot tell this host's address on its route to the Spark Connect server {host} "
        f"({failure}): set {CONNECT_HOST_CONF} to the address the server's executors reach this host at."
    ) from failure


def connect_driver_address(
    conf: Callable[[str], str | None], server_host: str, local: bool, naming: RunnerNaming = HOROVOD_RUNNER
) -> DriverAddress:
    """The driver's address over Spark Connect: the agents reach this process, the client, not the server's
    driver.

    ``spark.horovodRunner.driverHost`` (else this host's address on its route to the server) is what the agents
    are told, ``spark.horovodRunner.driverBindAddress`` (else that address) where the driver listens. A server
    reached over loopback runs on this host: its executors on a local master reach loopback (IPv4's, as on a
    classic local master, also where the route is ``::1``), those of a cluster the address its own driver gave
    them (``spark.driver.host``, an address of this host).
    """
    channel, rendezvous = _ports(conf, naming)
    host, bind = conf(CONNECT_HOST_CONF), conf(CONNECT_BIND_CONF)
    if not host:
        host = route_address(server_host, naming)
        if ipaddress.ip_address(host.split("%")[0]).is_loopback:
            host = LOOPBACK if local else conf(HOST_CONF) or socket.gethostname()
        settings = f"{CONNECT_BIND_CONF}={bind}" if bind else f"this host's address on its route to {server_host}"
    else:
        settings = f"{CONNECT_BIND_CONF}={bind}" if bind else f"{CONNECT_HOST_CONF}={host}"
    return DriverAddress(
        host,
        bind or host,
        channel,
        rendezvous,
        settings,
        naming,
        bind_setting=f"{CONNECT_BIND_CONF}, or {CONNECT_HOST_CONF} for the address the agents are told too",
        host_setting=CONNECT_HOST_CONF,
    )


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
