"""Keras callbacks for HorovodRunner ranks.

``LogCallback``: training progress to the driver's log, through :func:`log_to_driver`, and its epoch metrics
as data, through :func:`log_metrics`. ``CheckpointCallback``: save the model at each epoch's end (rank 0), then
:func:`report_checkpoint`, so that a retry can resume with :func:`last_checkpoint`.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from airflow_provider_hvd.runner.rank.control import log_to_driver
from airflow_provider_hvd.runner.rank.progress import log_metrics, report_checkpoint


def _is_rank0() -> bool:
    return os.environ.get("HOROVOD_RANK", "0") == "0"


def _numbers(logs: dict[str, Any] | None) -> dict[str, float]:
    numbers = {}
    for name, value in (logs or {}).items():
        try:
            numbers[name] = float(value)
        except (TypeError, ValueError):  # an array of several values, a string: not a curve
            continue
    return numbers


def _format_value(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):  # a tensor or array of several values, a string...
        value = value.tolist() if hasattr(value, "tolist") else value
        return str(value)


def _format_logs(logs: dict[str, Any] | None) -> str:
    return " ".join(f"{name}={_format_value(value)}" for name, value in (logs or {}).items())


class LogCallback(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no type information
    """Send epoch begin/end (and, with ``per_batch_log=True``, every batch end) with Keras' ``logs`` dict.

    Lines read ``epoch 3/10 end: loss=0.2134 accuracy=0.91``. Only rank 0 sends, unless ``all_ranks=True``
    (each rank's lines are tagged with its rank on the driver anyway). Works with any Keras 3 backend.
    Each epoch's numeric metrics are also reported with ``log_metrics(epoch, ...)`` (epochs counted from 1).
    """

    def __init__(self, per_batch_log: bool = False, all_ranks: bool = False) -> None:
        super().__init__()
        self.per_batch_log = per_batch_log
        self.all_ranks = all_ranks
        self._epoch = 0

    def _send(self, message: str) -> None:
        if self.all_ranks or _is_rank0():
            log_to_driver(message)

    def _of_epochs(self) -> str:
        epochs = (self.params or {}).get("epochs")
        return f"{self._epoch + 1}/{epochs}" if epochs else str(self._epoch + 1)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._send(f"epoch {self._of_epochs()} begin")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._send(f"epoch {self._of_epochs()} end: {_format_logs(logs)}".rstrip(": "))
        metrics = _numbers(logs)
        if metrics and (self.all_ranks or _is_rank0()):
            log_metrics(epoch + 1, **metrics)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.per_batch_log:
            steps = (self.params or {}).get("steps")
            of_steps = f"{batch + 1}/{steps}" if steps else str(batch + 1)
            self._send(f"epoch {self._of_epochs()} batch {of_steps} end: {_format_logs(logs)}".rstrip(": "))


class CheckpointCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Save the model at the end of every ``every``-th epoch on rank 0, then report it with ``report_checkpoint``.

    ``path`` may hold ``{epoch}`` (epochs counted from 1): ``"/shared/ckpt/epoch-{epoch}.keras"``. It must be
    where the next try's ranks can read it (shared storage on a cluster). The checkpoint's info is
    ``epoch`` (the epochs done), to resume with::

        ckpt = last_checkpoint()
        if ckpt:
            model = keras.models.load_model(ckpt["path"])
        model.fit(..., initial_epoch=ckpt["epoch"] if ckpt else 0, callbacks=[CheckpointCallback(path)])

    A path ending in ``.weights.h5`` saves the weights only (``model.load_weights`` then).
    """

    def __init__(self, path: str, every: int = 1) -> None:
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.path = str(path)
        self.every = every

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        done = epoch + 1
        if done % self.every or not _is_rank0():
            return
        path = self.path.format(epoch=done)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if path.endswith(".weights.h5"):
            self.model.save_weights(path)
        else:
            self.model.save(path)
        report_checkpoint(path, epoch=done)
