"""What kind of ranks a run starts: Horovod's or plain torch.distributed's (everything else is shared).

A kind serves the ranks' rendezvous on the driver, gives each agent its rank (ranks on one node
contiguous, in agent order: a node is a host for Horovod, as in Horovod's own host assignment; a Spark task
for torch, as in PySpark's TorchDistributor, which runs ``torchrun`` in each task) and sets each rank's
environment: Horovod's Gloo rendezvous and ``HOROVOD_*``
variables, or ``torchrun``'s ``env://`` contract around a ``TCPStore`` the driver serves. Their consequence
errors (one rank's reaction to another's failure) are in :mod:`..verdict.consequences`. Only the Horovod kind
imports Horovod, when a run of it starts.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import LaunchError
from ...shared import torch_env
from ...shared.messages import Hello
from ..launch.address import RENDEZVOUS, STORE, DriverAddress, address_family, listening_socket

if TYPE_CHECKING:
    from .horovod import Rendezvous

HOROVOD_MISSING = (
    "HorovodRunner needs Horovod on the driver and on every executor, and it is not installed here. "
    "Horovod 0.28.1 does not build from PyPI against torch >= 2.1: install it with this project's "
    'scripts/install_horovod.py (see the README\'s "Install"), e.g. `python scripts/install_horovod.py`.'
)
TORCH_MISSING = "TorchDistributor needs torch on the driver and on every executor: pip install torch"
_STORE_BACKLOG = 1024


class Slot(Protocol):
    """One agent's rank (the fields of Horovod's ``SlotInfo``); ``hostname`` names its node (GPUs are shared
    by the ranks of a node, :mod:`...shared.gpus`)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


class RankKind(Protocol):
    name: str  # as the driver's log says it
    unencrypted: str  # what travels between the ranks that the kind cannot encrypt (..launch.spark.encryption)

    def open(self, driver: DriverAddress) -> str:
        """Serve the rendezvous on the driver's address; where it listens, for the log."""

    def plan(self, hellos: Sequence[Hello], peers: Sequence[str]) -> Sequence[Slot]:
        """Each agent's rank (``hellos[i]``: agent i's hello; ``peers[i]``: its address as the driver sees it)."""

    def env(self, slot: Slot) -> dict[str, str]:
        """What makes the rank with ``slot`` join this run."""

    def close(self) -> None: ...


@dataclass
class NodeSlot:
    hostname: str  # the node: a host, or a Spark task on its host
    rank: int
    local_rank: int
    cross_rank: int  # the node's index
    size: int
    local_size: int
    cross_size: int  # the number of nodes


def plan_by_node(nodes: Sequence[str]) -> list[NodeSlot]:
    """Ranks in agent order within each node (``nodes[i]``: agent i's), nodes in the order of their first agent;
    slots in agent order."""
    per_node: OrderedDict[str, list[int]] = OrderedDict()
    for agent, node in enumerate(nodes):
        per_node.setdefault(node, []).append(agent)
    slots: list[NodeSlot | None] = [None] * len(nodes)
    rank = 0
    for index, (node, agents) in enumerate(per_node.items()):
        for local_rank, agent in enumerate(agents):
            slots[agent] = NodeSlot(node, rank, local_rank, index, len(nodes), len(agents), len(per_node))
            rank += 1
    return [slot for slot in slots if slot is not None]


def torch_node(hello: Hello) -> str:
    """A torch rank's node: its Spark task (PySpark runs ``torchrun`` in each), or its host for local runs."""
    return hello.host if hello.executor is None else f"{hello.host} (Spark task {hello.partition})"


class HorovodKind:
    """Horovod's ranks: its Gloo rendezvous server on the driver, the ``HOROVOD_*`` slot variables."""

    name = "Horovod"
    unencrypted = (
        "Horovod's Gloo traffic between the ranks (the tensors, and its rendezvous) cannot be encrypted by Horovod"
    )

    def __init__(self) -> None:
        try:
            from . import horovod as rendezvous
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] == "horovod":
                raise LaunchError(HOROVOD_MISSING) from exc
            raise
        self._module = rendezvous
        self._rendezvous: Rendezvous | None = None

    def open(self, driver: DriverAddress) -> str:
        if address_family(driver.advertised) == socket.AF_INET6:
            raise LaunchError(
                f"Horovod's ranks cannot reach the driver at {driver.advertised} "
                f"({driver.address_settings or 'loopback'}): Horovod's Gloo rendezvous takes IPv4 only (its ranks' "
                f"HTTP client). Set {driver.host_setting} to an IPv4 address of this host that the executors reach "
                "(TorchDistributor's ranks work over IPv6 too)."
            )
        self._rendezvous = driver.listen(
            RENDEZVOUS, lambda host, port: self._module.Rendezvous(host, port, driver.advertised)
        )
        return f"Gloo rendezvous on {driver.describe(self._rendezvous.port)}"

    def plan(self, hellos: Sequence[Hello], peers: Sequence[str]) -> Sequence[Slot]:
        assert self._rendezvous is not None
        plan: list[Any] = self._module.plan_ranks([hello.host for hello in hellos])  # Horovod's host assignment
        self._rendezvous.init(plan, peers)
        return plan

    def env(self, slot: Slot) -> dict[str, str]:
        from ...shared.horovod_env import forwarded_settings, slot_env

        assert self._rendezvous is not None
        return {
            **forwarded_settings(os.environ),
            **slot_env(slot, self._rendezvous.host, self._rendezvous.port),
        }

    def close(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.stop()


class TorchKind:
    """torch.distributed's ranks: a ``TCPStore`` served by the driver, ``torchrun``'s environment.

    The driver serves the store (as ``torchrun``'s agent does, ``TORCHELASTIC_USE_AGENT_STORE``): its address
    is one every agent has just reached, its port is bound here (no rank races for a free port on its host),
    and it outlives every rank, so that a failing rank 0 does not take the store from its peers.
    """

    name = "torch.distributed"
    unencrypted = (
        "torch.distributed's traffic between the ranks (Gloo's or NCCL's tensors, and its store on the driver) "
        "cannot be encrypted by torch"
    )

    def __init__(self) -> None:
        try:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (torch's stubs omit it)
        except ModuleNotFoundError as exc:
            raise LaunchError(TORCH_MISSING) from exc
        self._store_class = TCPStore
        self._store: Any = None
        self._advertised = ""
        self._port = 0
        self.run_id = f"hvd-{secrets.token_hex(8)}"

    def _serve(self, host: str, port: int) -> Any:
        # bound here, not by the store (which would listen on every interface): only the driver's address
        listener = listening_socket(host, port, _STORE_BACKLOG)
        try:
            store = self._store_class(
                host, listener.getsockname()[1], None, True, wait_for_workers=False, master_listen_fd=listener.fileno()
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store's server owns the socket now
        return store

    def open(self, driver: DriverAddress) -> str:
        self._store = driver.listen(STORE, self._serve)
        self._advertised, self._port = driver.advertised, int(self._store.port)
        return f"torch.distributed store (TCPStore) on {driver.describe(self._port)}"

    def plan(self, hellos: Sequence[Hello], peers: Sequence[str]) -> Sequence[Slot]:
        return plan_by_node([torch_node(hello) for hello in hellos])

    def env(self, slot: Slot) -> dict[str, str]:
        return torch_env.slot_env(slot, self._advertised, self._port, self.run_id, os.environ)

    def close(self) -> None:
        self._store = None  # the last reference: its server stops and closes its socket
