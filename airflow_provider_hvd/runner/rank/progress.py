"""Progress as data, in the rank process: :func:`log_metrics`, :func:`report_checkpoint`, :func:`last_checkpoint`.

Metrics and checkpoints travel on the control pipe to the agent, which relays them to the driver; the driver
keeps a bounded history and the last checkpoint (:mod:`..driver.tracking.progress`). The checkpoint a run resumes from
reaches every rank in its environment (``HVD_RUNNER_LAST_CHECKPOINT``, JSON), set by the driver.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

from ..shared.messages import RankCheckpoint, RankMetrics
from .control import control_pipe

LAST_CHECKPOINT_ENV = "HVD_RUNNER_LAST_CHECKPOINT"
MAX_METRICS = 64  # names per call
MAX_NAME_CHARS = 100
MAX_INFO_BYTES = 8 << 10  # a checkpoint's info, as JSON: it travels to every rank of the next try
RESERVED_INFO = ("path", "try_number", "rank", "reported_at", "finished")  # keys the driver sets itself


def _number(name: str, value: Any) -> float | None:
    """``value`` as a float (a 0-d tensor or array too); None for NaN or infinity (JSON has neither)."""
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or hasattr(value, "item")):
        raise TypeError(f"log_metrics(): {name}={value!r} is not a number; pass a float (e.g. loss.item())")
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError) as exc:  # a tensor of several values
        raise TypeError(f"log_metrics(): {name} is not one number ({exc}); pass a float") from None
    return number if math.isfinite(number) else None


def numeric(values: Mapping[str, Any] | None) -> dict[str, float]:
    """The values that are one number each (floats, ints, NumPy scalars, one-element tensors), as floats: what of a
    framework's logs can be a curve (not a string, nor an array of several values)."""
    found = {}
    for name, value in (values or {}).items():
        try:
            found[name] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return found


def log_metrics(step: int | float, **metrics: Any) -> None:
    """Report numbers for one step of training (``step``: the x-axis, an epoch or a global step).

    ``log_metrics(3, loss=0.21, accuracy=0.93)``. The driver keeps a bounded history of rank 0's metrics
    (``HorovodRunner.metrics`` after the run; in an Airflow task, the task state store while it runs). Values
    are floats (or 0-d tensors); NaN and infinity are kept as gaps. Outside a running job the metrics are
    printed.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step):
        raise TypeError(f"log_metrics(): step must be a finite number (an epoch or a global step), not {step!r}")
    if not metrics:
        raise TypeError("log_metrics() takes at least one metric, e.g. log_metrics(epoch, loss=0.2)")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"log_metrics() takes at most {MAX_METRICS} metrics per call, not {len(metrics)}")
    values = {name[:MAX_NAME_CHARS]: _number(name, value) for name, value in metrics.items()}
    step = int(step) if float(step).is_integer() else float(step)
    pipe = control_pipe()
    if pipe is None:
        print(
            f"step {step}: "
            + " ".join(f"{name}={value:.4g}" if value is not None else f"{name}=nan" for name, value in values.items()),
            flush=True,
        )
        return
    pipe.send(RankMetrics(step, values, time.time()))


def report_checkpoint(path: str | os.PathLike[str], **info: Any) -> None:
    """Tell the driver a checkpoint is durably written at ``path`` (call it after the file is closed).

    ``info`` is what the next try needs to resume (``epoch=4``), JSON values, at most 8 KB. The driver keeps
    the last one reported (``HorovodRunner.checkpoint``; in an Airflow task, the task state store, where
    :func:`last_checkpoint` finds it on the next try). Outside a running job it is printed.
    """
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"report_checkpoint(): path must be a non-empty str, not {path!r}")
    reserved = sorted(set(info) & set(RESERVED_INFO))
    if reserved:
        raise ValueError(f"report_checkpoint(): {reserved} are set by the driver; name the info differently")
    try:
        size = len(json.dumps(info, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"report_checkpoint(): info must be JSON (numbers, strings, lists, dicts): {exc}") from None
    if size > MAX_INFO_BYTES:
        raise ValueError(
            f"report_checkpoint(): info is {size} bytes as JSON, more than {MAX_INFO_BYTES}; "
            "keep it small (an epoch, a step, a metric) and put the rest in the checkpoint itself"
        )
    pipe = control_pipe()
    if pipe is None:
        print(f"checkpoint {path} {json.dumps(info)}", flush=True)
        return
    pipe.send(RankCheckpoint(path, info, time.time()))


def last_checkpoint() -> dict[str, Any] | None:
    """The checkpoint to resume from, or None to start afresh.

    A dict: ``"path"``, the info it was reported with (``"epoch"``...), ``"try_number"`` (the Airflow try that
    reported it, or None outside Airflow) and ``"rank"``. Every rank sees the same value, from the start of
    ``main``: in an Airflow task, the last checkpoint an earlier try of this task instance reported; with
    ``HorovodRunner(resume_from=...)``, that one.
    """
    value = os.environ.get(LAST_CHECKPOINT_ENV)
    return json.loads(value) if value else None
