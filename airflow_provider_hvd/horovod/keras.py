"""``LogCallback``: Keras training progress to the driver's log, through :func:`log_to_driver`."""

from __future__ import annotations

import os
from typing import Any

import keras

from airflow_provider_hvd.runner.rank.control import log_to_driver


def _format_value(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):  # a tensor or array of several values, a string...
        value = value.tolist() if hasattr(value, "tolist") else value
        return str(value)


def _format_logs(logs: dict[str, Any] | None) -> str:
    return " ".join(f"{name}={_format_value(value)}" for name, value in (logs or {}).items())


class LogCallback(keras.callbacks.Callback):
    """Send epoch begin/end (and, with ``per_batch_log=True``, every batch end) with Keras' ``logs`` dict.

    Lines read ``epoch 3/10 end: loss=0.2134 accuracy=0.91``. Only rank 0 sends, unless ``all_ranks=True``
    (each rank's lines are tagged with its rank on the driver anyway). Works with any Keras 3 backend.
    """

    def __init__(self, per_batch_log: bool = False, all_ranks: bool = False) -> None:
        super().__init__()
        self.per_batch_log = per_batch_log
        self.all_ranks = all_ranks
        self._epoch = 0

    def _send(self, message: str) -> None:
        if self.all_ranks or os.environ.get("HOROVOD_RANK", "0") == "0":
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

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.per_batch_log:
            steps = (self.params or {}).get("steps")
            of_steps = f"{batch + 1}/{steps}" if steps else str(batch + 1)
            self._send(f"epoch {self._of_epochs()} batch {of_steps} end: {_format_logs(logs)}".rstrip(": "))
