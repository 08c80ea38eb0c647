"""Which GPUs each rank sees: those Spark gave its task (``np > 0``), or this host's (``np < 0``).

One GPU per rank (the usual case): every rank on a host sees the GPUs of all this run's ranks on that host,
ordered by local rank, so that Horovod's ``torch.cuda.set_device(hvd.local_rank())`` selects the rank's own
GPU and NCCL sees its peers. Several GPUs per rank, or GPUs shared by ranks (a fractional
``spark.task.resource.gpu.amount``): each rank sees only its own, its first as ``cuda:0``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

GPU = "gpu"  # Spark's resource name
_NVIDIA_SMI_GPU = re.compile(r"^GPU (\d+):", re.MULTILINE)


def visible_gpus(own: Sequence[Sequence[str]]) -> list[list[str] | None]:
    """What each rank on one host sees, from the GPUs each was given (``own``, in local-rank order).

    None for every rank when none was given GPUs: the rank's environment is left as it is.
    """
    if not any(own):
        return [None] * len(own)
    firsts = [gpus[0] for gpus in own if len(gpus) == 1]
    if len(firsts) == len(own) and len(set(firsts)) == len(firsts):
        return [list(firsts) for _ in own]
    return [list(dict.fromkeys(gpus)) for gpus in own]


def gpu_env(gpus: Sequence[str] | None) -> dict[str, str]:
    """The CUDA settings that make a rank see ``gpus`` (in that order; none when empty); nothing when None."""
    if gpus is None:
        return {}
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}  # as PySpark's TorchDistributor hides them for use_gpu=False
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def spark_gpus_here(addresses: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The GPUs Spark's ``addresses`` name, as CUDA numbers them in a process with ``environ``.

    As PySpark's TorchDistributor reads them: where ``CUDA_VISIBLE_DEVICES`` is set, Spark's addresses index its
    list. ValueError for an address that CUDA cannot take (not a whole number without leading zeros).
    """
    if any(not re.fullmatch(r"0|[1-9][0-9]*", address) for address in addresses):
        raise ValueError(
            f"Found GPU addresses {list(addresses)} which are not all in the correct format for CUDA_VISIBLE_DEVICES, "
            "which requires integers with no zero padding."
        )
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return list(addresses)
    visible = environ["CUDA_VISIBLE_DEVICES"].split(",")
    return [visible[int(address)] for address in addresses]


def host_gpus(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """This host's GPUs as the driver may use them, and where that came from.

    ``CUDA_VISIBLE_DEVICES`` when set (empty: none), else the GPUs ``nvidia-smi -L`` lists, else none.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        listed = [gpu.strip() for gpu in environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
        return listed, f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return [], "no nvidia-smi on PATH"
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [], "nvidia-smi -L failed"
    return _NVIDIA_SMI_GPU.findall(listing), "nvidia-smi -L"
