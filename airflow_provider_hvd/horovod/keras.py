"""``LogCallback``: Keras training progress to the driver's log, through :func:`log_to_driver`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from airflow_provider_hvd.runner.control import log_to_driver


def _format_value(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):  # a tensor or array of several values, a string...
        value = value.tolist() if hasattr(value, "tolist") else value
        return str(value)


def _format_logs(logs: dict[str, Any] | None) -> str:
    return " ".join(f"{name}={_format_value(value)}" for name, value in (logs or {}).items())


def _unused(hook: Callable) -> Callable:
    """Mark a hook as not implemented: Keras 3 and tf.keras (Keras 2) then need not call it every batch."""
    hook._is_default = True  # the marker both Keras versions' `is_default` reads
    return hook


class LogCallback:
    """Send epoch begin/end (and, with ``per_batch_log=True``, every batch end) with Keras' ``logs`` dict.

    Lines read ``epoch 3/10 end: loss=0.2134 accuracy=0.91``. Only rank 0 sends, unless ``all_ranks=True``
    (each rank's lines are tagged with its rank on the driver anyway).

    A callback for ``model.fit`` of Keras 3 (any backend) and of ``tf.keras`` with Keras 2 (tf-keras, what
    Horovod's Keras integration needs): it implements the callback protocol both call rather than deriving
    from either's ``Callback`` class, so it imports neither.
    """

    def __init__(self, per_batch_log: bool = False, all_ranks: bool = False) -> None:
        self.per_batch_log = per_batch_log
        self.all_ranks = all_ranks
        self.params: dict[str, Any] = {}
        self.model: Any = None
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

    # --- the rest of the callback protocol that Keras 3's and tf.keras's CallbackList call -------------------
    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def set_model(self, model: Any) -> None:
        self.model = model

    def _implements_train_batch_hooks(self) -> bool:  # tf.keras asks, to skip batch hooks nobody needs
        return self.per_batch_log

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    @_unused
    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None: ...
