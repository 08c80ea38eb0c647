"""A rank's environment, computed by its agent where the rank runs.

On top of the agent's own environment (the executor's, with ``spark.executorEnv.*``; the driver's for
local runs): the driver's own ``HOROVOD_*`` settings (``HOROVOD_TIMELINE``, ``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_CYCLE_TIME``, ...; every one but those HorovodRunner sets itself, :mod:`..shared.horovod_env`), then the
rank's Horovod slot, the Gloo interface that reaches the driver, and ``OMP_NUM_THREADS`` from the cores the
rank was given (the Spark task's cores; a share of this host's cores for local runs), unless set explicitly,
the GPUs it sees (:mod:`.gpus`; none at all when hidden), and :data:`KERAS_2_FOR_TENSORFLOW` unless set. A
torch.distributed rank gets ``torchrun``'s variables instead of Horovod's (:mod:`..shared.torch_env`), and
Gloo's and NCCL's interface that reaches the driver unless set.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping

import psutil

from ..rank.control import RANK_ENV
from ..shared import torch_env
from ..shared.gpus import gpu_env
from ..shared.horovod_env import GLOO_IFACE
from ..shared.messages import Hello, Start

# Horovod 0.28.1's Keras integration works with Keras 2 only: tf.keras is Keras 2 (the tf-keras package) when this
# is set before TensorFlow is imported. A rank's own setting (spark.executorEnv, the driver's for local runs) wins.
KERAS_2_FOR_TENSORFLOW = "TF_USE_LEGACY_KERAS"


def keras_defaults() -> dict[str, str]:
    """``TF_USE_LEGACY_KERAS=1`` where tf-keras is installed (without it, the setting would break ``tf.keras``)."""
    return {KERAS_2_FOR_TENSORFLOW: "1"} if importlib.util.find_spec("tf_keras") is not None else {}


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip``, IPv4 or IPv6 (Gloo binds its transport to an interface)."""
    bare = ip.split("%")[0]  # (an IPv6 link-local address's zone)
    for name, addrs in psutil.net_if_addrs().items():
        if any(
            addr.family in (socket.AF_INET, socket.AF_INET6) and addr.address.split("%")[0] == bare for addr in addrs
        ):
            return name
    if bare.startswith("127.") or bare == "::1":
        return "lo"
    raise RuntimeError(f"no network interface holds {ip}, the address this host uses to reach the driver")


def omp_threads(hello: Hello, local_size: int) -> int:
    """Threads per rank: the cores Spark gave the task, or this host's cores shared by its ranks."""
    if hello.cpus is not None:
        return max(1, hello.cpus)
    return max(1, (os.cpu_count() or 1) // local_size)


def rank_environment(
    base: Mapping[str, str], hello: Hello, start: Start, keep_omp_threads: bool, hide_gpus: bool = False
) -> dict[str, str]:
    """The environment of the rank process that ``start`` starts on this agent.

    ``keep_omp_threads``: ``OMP_NUM_THREADS`` in ``base`` was set explicitly (``spark.executorEnv``, or the
    driver's environment for local runs), so it stays; else it is computed. ``hide_gpus``: a rank given no
    GPU sees none (``CUDA_VISIBLE_DEVICES=""``) instead of those ``base`` shows.
    """
    iface = interface_of(hello.host)
    gpus = start.gpus if start.gpus is not None or not hide_gpus else []
    env = {
        **keras_defaults(),
        **base,
        **start.env,
        **gpu_env(gpus),
        GLOO_IFACE: iface,
        RANK_ENV: str(start.rank),
        "PYTHONUNBUFFERED": "1",
    }
    if start.kind == torch_env.KIND:
        env.update({name: iface for name in torch_env.IFACE_VARS if name not in base})
    if not (keep_omp_threads and "OMP_NUM_THREADS" in base):
        env["OMP_NUM_THREADS"] = str(omp_threads(hello, start.local_size))
    return env
