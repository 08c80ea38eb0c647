"""Several hosts on this machine: each a Linux network + UTS namespace on one bridge, with a Spark standalone
worker inside; the master and the driver on the bridge's address.

Each host has its own IPv4 address in a private /24 that nothing else on this machine uses, its own hostname
and ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/NAME/*`` over ``/etc``), a ``resolv.conf`` pointing
at nothing and NO default route: a host reaches only the bridge's /24, and no packet leaves this machine. Its
interface is named ``eth0`` or ``hvd0`` in turn, so that the interface names differ between hosts.
``ip link set <host.link> down`` cuts a host off: its packets vanish, no FIN or RST reaches anyone.

Names and the subnet come from this process's pid (a CI job and a developer may run at once); everything is
removed by :meth:`Hosts.stop`: the processes in the namespaces, the namespaces, the bridge, the /etc/netns dirs.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pyspark
from jvm import daemon_env

IFACE_NAMES = ("eth0", "hvd0")
DRIVER_NAME = "hvd-driver"
_NETNS_ETC = Path("/etc/netns")


def cannot_make_hosts() -> str | None:
    """Why namespace hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add, a bridge, veth pairs)"
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2's `ip` (not found on PATH)"
    if shutil.which("unshare") is None:
        return "network-namespace hosts need util-linux's `unshare` (not found on PATH)"
    probe = f"hvdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address or a route in (in its own namespace)."""
    used = []
    for line in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for line in subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout.splitlines():
        dest = line.split()[0]
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if dest != "default" else "0.0.0.0/32"  # a default route is not a network to avoid
        try:
            used.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            pass
    return used


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps, picked from ``seed`` on."""
    used = _networks_in_use()
    for step in range(4096):
        n = (seed * 7919 + step) % (200 * 250)
        subnet = ipaddress.ip_network(f"10.{50 + n // 250}.{n % 250 + 1}.0/24")
        if not any(subnet.overlaps(net) for net in used if net.prefixlen > 0):
            return subnet
    raise RuntimeError("no free /24 in 10.0.0.0/8 for the test hosts")


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(eq=False)  # one object per host: hashed and compared by identity
class Host:
    index: int
    name: str  # its hostname
    netns: str
    address: str
    iface: str  # its interface's name inside the namespace
    link: str  # its veth end on the bridge: `ip link set LINK down` cuts it off
    cores: int
    gpus: int
    worker: subprocess.Popen | None = None

    def pids(self) -> list[int]:
        """Every process running in this host's network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def reconnect(self) -> None:
        _ip("link", "set", self.link, "up")


class Hosts:
    """``len(cores)`` hosts, host i with ``cores[i]`` cores and ``gpus[i]`` made-up GPUs ("0", "1", ... on each
    host, as on real ones), each running a Spark standalone worker of a master on the bridge's address."""

    _made_here = 0

    def __init__(
        self, workdir: Path, cores: list[int], gpus: list[int] | None = None, worker_memory: str = "1g"
    ) -> None:
        self.workdir = workdir
        Hosts._made_here += 1  # a second set in this process gets names of its own
        self.tag = f"{os.getpid()}{chr(ord('a') + Hosts._made_here % 26)}"
        self.subnet = free_subnet(os.getpid() * 31 + Hosts._made_here)
        addresses = list(self.subnet.hosts())
        self.driver_address = str(addresses[0])  # the bridge's: the master and the driver listen here
        self.bridge = f"hvb{self.tag}"
        gpus = gpus or [0] * len(cores)
        self.hosts = [
            Host(
                i,
                f"host-{i}",
                f"hvd{self.tag}h{i}",
                str(addresses[i + 1]),
                IFACE_NAMES[i % len(IFACE_NAMES)],
                f"hv{self.tag}v{i}",
                cores[i],
                gpus[i],
            )
            for i in range(len(cores))
        ]
        self.spark_home = Path(pyspark.__file__).parent
        self.worker_memory = worker_memory
        self.port = _free_port("127.0.0.1")
        self.ui_port = _free_port("127.0.0.1")
        self.url = f"spark://{self.driver_address}:{self.port}"
        self.web_ui = f"http://{self.driver_address}:{self.ui_port}"
        self._master: subprocess.Popen | None = None
        self._made_bridge = False
        self._made: list[Host] = []

    def session_conf(self) -> dict[str, str]:
        """What a SparkSession of the driver needs to live on the bridge (not on conftest's loopback)."""
        return {
            "spark.driver.host": self.driver_address,
            "spark.driver.bindAddress": self.driver_address,
            "spark.horovodRunner.masterWebUiUrl": self.web_ui,
            "spark.executor.memory": "512m",
        }

    # making them

    def start(self, timeout: float = 180.0) -> Hosts:
        try:
            self._make_network()
            self._spawn_master()
            for host in self.hosts:
                self._spawn_worker(host)
            deadline = time.monotonic() + timeout
            while self.alive_workers() < len(self.hosts):
                dead = [
                    p for p in [self._master, *(h.worker for h in self.hosts)] if p is not None and p.poll() is not None
                ]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"the Spark cluster on the namespace hosts did not come up; see {self.workdir}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def _make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _write_sysctl(f"net/ipv6/conf/{self.bridge}/disable_ipv6", "1")
        _ip("addr", "add", f"{self.driver_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        etc_hosts = (
            "127.0.0.1 localhost\n"
            + f"{self.driver_address} {DRIVER_NAME}\n"
            + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        )
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            self._made.append(host)
            etc = _NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(etc_hosts)
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # nothing answers: no lookup leaves the host
            (etc / "hostname").write_text(host.name + "\n")
            _ip("link", "add", host.link, "type", "veth", "peer", "name", host.iface, "netns", host.netns)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("netns", "exec", host.netns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.iface)
            _ip("-n", host.netns, "link", "set", host.iface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            # no default route, on purpose: this host reaches the bridge's /24 and nothing else

    def _env(self, bind: str) -> dict[str, str]:
        return {
            **os.environ,
            **daemon_env(),
            "SPARK_HOME": str(self.spark_home),
            "SPARK_LOCAL_IP": bind,
            "SPARK_DAEMON_MEMORY": "256m",
            # a worker given SIGPWR decommissions itself and its executors (the preemption test)
            "SPARK_WORKER_OPTS": "-Dspark.decommission.enabled=true",
            # the master keeps a worker whose host is cut off for most of a minute (it removes it after 60 s by
            # default): under load, a worker it had removed took no executor for minutes once its host was back
            "SPARK_MASTER_OPTS": "-Dspark.worker.timeout=300",
        }

    def _spawn_master(self) -> None:
        with open(self.workdir / "master.log", "wb") as log:
            self._master = subprocess.Popen(
                [
                    str(self.spark_home / "bin" / "spark-class"),
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    self.driver_address,
                    "--port",
                    str(self.port),
                    "--webui-port",
                    str(self.ui_port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(self.driver_address),
                start_new_session=True,
            )

    def _spawn_worker(self, host: Host) -> None:
        work = self.workdir / host.name
        work.mkdir(parents=True, exist_ok=True)
        command = [
            str(self.spark_home / "bin" / "spark-class"),
            "org.apache.spark.deploy.worker.Worker",
            self.url,
            "--host",
            host.address,
            "--cores",
            str(host.cores),
            "--memory",
            self.worker_memory,
            "--webui-port",
            "8081",
            "--work-dir",
            str(work),
            *self._gpu_properties(host, work),
        ]
        with open(self.workdir / f"{host.name}.log", "wb") as log:
            host.worker = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.netns,
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {host.name} && exec "$@"',
                    "sh",
                    *command,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(host.address),
                start_new_session=True,
            )

    @staticmethod
    def _gpu_properties(host: Host, work: Path) -> list[str]:
        if not host.gpus:
            return []
        script = work / "gpus.sh"
        addresses = [str(i) for i in range(host.gpus)]
        script.write_text(f"#!/bin/sh\necho '{json.dumps({'name': 'gpu', 'addresses': addresses})}'\n")
        script.chmod(0o755)
        properties = work / "worker.properties"
        properties.write_text(
            f"spark.worker.resource.gpu.amount {host.gpus}\nspark.worker.resource.gpu.discoveryScript {script}\n"
        )
        return ["--properties-file", str(properties)]

    def _master_state(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.web_ui}/json/", timeout=2) as resp:
                return json.load(resp)
        except (OSError, ValueError):
            return {}

    def alive_workers(self) -> int:
        return int(self._master_state().get("aliveworkers", 0))

    def wait_idle(self, timeout: float = 180.0) -> None:
        """Until the master has every host's worker alive with none of its cores used: an application of an
        earlier test has ended there, and a worker whose host was cut off has registered again (after a cut of
        most of a minute, under load, that took minutes)."""
        deadline = time.monotonic() + timeout
        while True:
            workers = {w.get("host"): w for w in self._master_state().get("workers", []) if w.get("state") == "ALIVE"}
            busy = [
                f"{h.name} ({h.address}): "
                + (f"{workers[h.address].get('coresused')} cores used" if h.address in workers else "not alive")
                for h in self.hosts
                if h.address not in workers or workers[h.address].get("coresused")
            ]
            if not busy:
                return
            assert time.monotonic() < deadline, f"the master's workers not idle after {timeout:g}s: {busy}"
            time.sleep(0.5)

    def by_address(self, address: str) -> Host:
        return next(host for host in self.hosts if host.address == address)

    # removing them

    def stop(self) -> None:
        """End every process in the namespaces and the master; remove the namespaces, the bridge, /etc/netns dirs."""
        for host in self._made:
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in [*(h.worker for h in self.hosts), self._master]:
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL if proc is not self._master else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for host in self._made:
            deadline = time.monotonic() + 10
            while host.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
            subprocess.run(["ip", "link", "delete", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True)
            shutil.rmtree(_NETNS_ETC / host.netns, ignore_errors=True)
        self._made = []
        if self._made_bridge:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
            self._made_bridge = False


def _write_sysctl(key: str, value: str) -> None:
    try:
        Path("/proc/sys", key).write_text(value)
    except OSError:
        pass


class LoopbackHost:
    """A host with loopback alone (a network namespace: no other interface, no route anywhere), whose
    ``/etc/hosts`` is ``etc_hosts`` (e.g. ``::1 localhost``: a host where ``localhost`` is IPv6's loopback, as on
    Debian, RHEL and many images with IPv6 up). :meth:`command` runs a command inside it; :meth:`stop` ends what
    runs there and removes the namespace and its /etc/netns dir."""

    _made_here = 0

    def __init__(self, etc_hosts: str) -> None:
        LoopbackHost._made_here += 1
        self.netns = f"hvdlo{os.getpid()}{LoopbackHost._made_here}"
        self.etc_hosts = etc_hosts
        self._made = False

    def start(self) -> LoopbackHost:
        _ip("netns", "add", self.netns)
        self._made = True
        try:
            etc = _NETNS_ETC / self.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.etc_hosts)
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # nothing answers: no lookup leaves the host
            _ip("-n", self.netns, "link", "set", "lo", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def stop(self) -> None:
        if not self._made:
            return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        shutil.rmtree(_NETNS_ETC / self.netns, ignore_errors=True)
        self._made = False
