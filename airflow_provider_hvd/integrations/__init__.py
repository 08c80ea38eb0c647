"""Callbacks for the frameworks that train inside the ranks: ``integrations.lightning`` (a Lightning ``Callback``)
and ``integrations.transformers`` (a Hugging Face ``TrainerCallback``), each one line to add. They send rank 0's
logged metrics through ``log_metrics`` and each checkpoint the framework saves, once it is whole, through
``report_checkpoint``; :func:`last_checkpoint_path` gives the framework the checkpoint to resume from. Importing
this package imports no framework (each module imports its own).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping

from airflow_provider_hvd.runner.rank.progress import MAX_METRICS, last_checkpoint, log_metrics

__all__ = ["last_checkpoint_path"]


def last_checkpoint_path() -> str | None:
    """The path of the checkpoint to resume from (``last_checkpoint()``'s), or None to start afresh:
    ``trainer.train(resume_from_checkpoint=last_checkpoint_path())`` (Hugging Face),
    ``trainer.fit(model, ckpt_path=last_checkpoint_path())`` (Lightning).

    :raises FileNotFoundError: the checkpoint is not on this host (it was saved where this try cannot read it).
    """
    checkpoint = last_checkpoint()
    if checkpoint is None:
        return None
    path = str(checkpoint["path"])
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"the checkpoint to resume from, {path} (reported by try {checkpoint.get('try_number')}, rank "
            f"{checkpoint.get('rank')}), is not on this host ({socket.gethostname()}): save checkpoints where every "
            "host of the next try can read them (a shared file system or a mounted bucket), or delete the task's "
            "hvd_checkpoint (its Task State Store) to start afresh"
        )
    return path


def send_metrics(step: int, metrics: Mapping[str, float]) -> None:
    """``log_metrics(step, **metrics)``, in calls of at most 64 metrics; NaN is sent as a gap."""
    names = sorted(metrics)
    for start in range(0, len(names), MAX_METRICS):
        log_metrics(step, **{name: metrics[name] for name in names[start : start + MAX_METRICS]})


def same(a: float | None, b: float) -> bool:
    """``a == b``, NaN equal to NaN."""
    return a is not None and (a == b or (math.isnan(a) and math.isnan(b)))
