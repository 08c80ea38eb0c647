"""What kind of ranks a run starts: Horovod's (:mod:`.horovod`) or plain torch.distributed's (:mod:`.torch`);
everything else is shared.

A kind serves the ranks' rendezvous on the driver, gives each agent its rank (:mod:`.plan`) and sets each rank's
environment: Horovod's Gloo rendezvous and ``HOROVOD_*`` variables, or ``torchrun``'s ``env://`` contract
around a ``TCPStore`` the driver serves. Their consequence errors (one rank's reaction to another's failure)
are in :mod:`..verdict.consequences`. Each kind is imported when a run of it starts: only Horovod's imports
Horovod.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ...errors import JobRefusedError

if TYPE_CHECKING:
    from ...shared.messages import Hello
    from ..launch.address import DriverAddress
    from .plan import Slot

HOROVOD_MISSING = (
    "HorovodRunner needs Horovod on the driver and on every executor, and it is not installed here. "
    "Horovod 0.28.1 does not build from PyPI against torch >= 2.1: install it with this project's "
    'scripts/install_horovod.py (see the README\'s "Install"), e.g. `python scripts/install_horovod.py`.'
)
TORCH_MISSING = "TorchDistributor needs torch on the driver and on every executor: pip install torch"


class RankKind(Protocol):
    name: str  # as the driver's log says it, and the agent is told (Start.kind)
    unencrypted: str  # what travels between the ranks that the kind cannot encrypt (..launch.spark.encryption)

    def open(self, driver: DriverAddress) -> str:
        """Serve the rendezvous on the driver's address; where it listens, for the log."""

    def plan(self, hellos: Sequence[Hello], peers: Sequence[str]) -> Sequence[Slot]:
        """Each agent's rank (``hellos[i]``: agent i's hello; ``peers[i]``: its address as the driver sees it)."""

    def env(self, slot: Slot) -> dict[str, str]:
        """What makes the rank with ``slot`` join this run."""

    def close(self) -> None: ...


def horovod_kind() -> RankKind:
    """Horovod's ranks; LaunchError when Horovod is not installed here."""
    try:
        from .horovod import HorovodKind
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "horovod":
            raise JobRefusedError(HOROVOD_MISSING) from exc
        raise
    return HorovodKind()


def torch_kind() -> RankKind:
    """torch.distributed's ranks; LaunchError when torch is not installed here."""
    try:
        from .torch import TorchKind
    except ModuleNotFoundError as exc:
        raise JobRefusedError(TORCH_MISSING) from exc
    return TorchKind()
