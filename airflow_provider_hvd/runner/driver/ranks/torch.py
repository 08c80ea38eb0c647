"""torch.distributed's ranks (:class:`TorchKind`): a ``TCPStore`` the driver serves, the rank plan by node (a
Spark task, as PySpark's TorchDistributor runs ``torchrun`` in each; :mod:`.plan`) and ``torchrun``'s ``env://``
variables. Loaded when a torch run starts (:func:`.kind.torch_kind`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (torch's stubs omit it)

from ...shared import torch_env
from ..launch.address import STORE, DriverAddress, listening_socket
from .plan import Slot, plan_by_node

if TYPE_CHECKING:
    from ...shared.messages import Hello

_STORE_BACKLOG = 1024


def torch_node(hello: Hello) -> str:
    """A torch rank's node: its Spark task (PySpark runs ``torchrun`` in each), or its host for local runs."""
    return hello.host if hello.executor is None else f"{hello.host} (Spark task {hello.partition})"


class TorchKind:
    """torch.distributed's ranks: a ``TCPStore`` served by the driver, ``torchrun``'s environment.

    The driver serves the store (as ``torchrun``'s agent does, ``TORCHELASTIC_USE_AGENT_STORE``): its address
    is one every agent has just reached, its port is bound here (no rank races for a free port on its host),
    and it outlives every rank, so that a failing rank 0 does not take the store from its peers.
    """

    name = torch_env.KIND
    unencrypted = (
        "torch.distributed's traffic between the ranks (Gloo's or NCCL's tensors, and its store on the driver) "
        "cannot be encrypted by torch"
    )

    def __init__(self) -> None:
        self._store: Any = None
        self._advertised = ""
        self._port = 0
        self.run_id = f"hvd-{secrets.token_hex(8)}"

    def _serve(self, host: str, port: int) -> Any:
        # bound here, not by the store (which would listen on every interface): only the driver's address
        listener = listening_socket(host, port, _STORE_BACKLOG)
        try:
            store = TCPStore(
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
