"""The ``torchrun`` variables a torch.distributed rank gets, written once for the driver and the agents.

With them ``torch.distributed.init_process_group(backend)`` joins the run with no arguments (``env://``), and
libraries that detect ``torchrun`` (``torch.distributed.is_torchelastic_launched()``: ``TORCHELASTIC_RUN_ID``)
see it. ``TORCHELASTIC_USE_AGENT_STORE=True`` tells every rank that the store at ``MASTER_ADDR:MASTER_PORT`` is
served for it (by torchrun's agent there; by the driver here), so that no rank binds a port of its own.
``NODE_RANK`` is PySpark's (its ranks on Spark have it: the task's index, which is ``GROUP_RANK``), and
``TORCHELASTIC_ERROR_FILE`` a file in the rank's own folder, set by its agent (:func:`error_file_env`), where
``torch.distributed.elastic``'s ``@record`` writes a failing rank's error as under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

KIND = "torch.distributed"  # the rank kind, as the driver names it to the agent (Start.kind) and in its texts
RUN_ID = "TORCHELASTIC_RUN_ID"  # torchrun's run id, in every torch rank's environment
# set by the agent to the interface that reaches the driver, unless the rank's environment sets them
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
ROLE_NAME = "default"  # torchrun's default --role
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default --signals-to-handle
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
NCCL_ASYNC_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class TorchSlot(Protocol):
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # the node's index: torchrun's node rank (GROUP_RANK)
    cross_size: int  # the number of nodes (GROUP_WORLD_SIZE)


def slot_env(
    slot: TorchSlot, master_addr: str, master_port: int, run_id: str, driver_env: Mapping[str, str]
) -> dict[str, str]:
    """The environment ``torchrun`` would give this rank, its store being ``master_addr:master_port``."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.cross_rank),
        "GROUP_WORLD_SIZE": str(slot.cross_size),
        "NODE_RANK": str(slot.cross_rank),
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(slot.size),
        "ROLE_NAME": ROLE_NAME,
        RUN_ID: run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
        NCCL_ASYNC_ERRORS: driver_env.get(NCCL_ASYNC_ERRORS, "1"),  # torchrun's default
    }


def error_file_env(env: Mapping[str, str], folder: str) -> dict[str, str]:
    """``TORCHELASTIC_ERROR_FILE`` in ``folder`` (the rank's own) for a torch.distributed rank's ``env``, as torchrun
    gives each rank a file of its own; nothing for a Horovod rank."""
    return {ERROR_FILE: os.path.join(folder, "error.json")} if RUN_ID in env else {}
