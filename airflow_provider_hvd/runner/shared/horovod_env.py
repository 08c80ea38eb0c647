"""The ``HOROVOD_*`` variables HorovodRunner sets for each rank, written once for the driver and the agents.

The driver computes a rank's slot variables (:func:`slot_env`) and forwards its own other ``HOROVOD_*``
settings (:func:`forwarded_settings`); the agent adds the Gloo interface (:data:`GLOO_IFACE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

KIND = "Horovod"  # the rank kind, as the driver names it to the agent (Start.kind) and in its texts
GLOO_IFACE = "HOROVOD_GLOO_IFACE"  # set by the agent: the interface that reaches the driver
SLOT_VARS = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "HOROVOD_HOSTNAME",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS",
)
# what HorovodRunner sets for each rank; the driver's own values of these are not forwarded
RUNNER_SET = frozenset({*SLOT_VARS, GLOO_IFACE})


class HorovodSlot(Protocol):
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # the host's index among those with a rank of this local rank (Horovod's cross communicator)
    cross_size: int
    hostname: str


def slot_env(slot: HorovodSlot, rendezvous_host: str, rendezvous_port: int) -> dict[str, str]:
    """The environment that makes ``hvd.init()`` in a rank process join this run over Gloo."""
    values = (
        slot.rank,
        slot.size,
        slot.local_rank,
        slot.local_size,
        slot.cross_rank,
        slot.cross_size,
        slot.hostname,
        rendezvous_host,
        rendezvous_port,
        "gloo",
        "gloo",
    )
    return {name: str(value) for name, value in zip(SLOT_VARS, values, strict=True)}


def forwarded_settings(driver_env: Mapping[str, str]) -> dict[str, str]:
    """The driver's ``HOROVOD_*`` settings that every rank gets (``HOROVOD_TIMELINE``, ``..._FUSION_THRESHOLD``...)."""
    return {key: value for key, value in driver_env.items() if key.startswith("HOROVOD_") and key not in RUNNER_SET}
