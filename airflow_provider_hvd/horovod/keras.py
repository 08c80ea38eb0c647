"""Keras callbacks for the ranks: ``LogCallback`` (progress to the driver's log and metrics) and
``CheckpointCallback`` (save, then ``report_checkpoint``).

Both work in a ``model.fit`` of Keras 3 (any backend) and of ``tf.keras`` with Keras 2 (tf-keras, what Horovod's
Keras integration needs): they implement the callback protocol both call rather than deriving from either's
``Callback`` class, so this module imports neither.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from airflow_provider_hvd.runner.rank.control import control_pipe, log_to_driver
from airflow_provider_hvd.runner.rank.progress import log_metrics, numeric, report_checkpoint


def _is_rank0() -> bool:
    return os.environ.get("HOROVOD_RANK", "0") == "0"


def _format_value(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):  # a tensor or array of several values, a string...
        value = value.tolist() if hasattr(value, "tolist") else value
        return str(value)


def _format_logs(logs: dict[str, Any] | None) -> str:
    return " ".join(f"{name}={_format_value(value)}" for name, value in (logs or {}).items())


def _unused(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark a hook as not implemented: Keras 3 and tf.keras (Keras 2) then need not call it every batch."""
    hook._is_default = True  # type: ignore[attr-defined]  # the marker both Keras versions' `is_default` reads
    return hook


class _Callback:
    """The callback protocol that Keras 3's and tf.keras's ``CallbackList`` call, every hook doing nothing."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.model: Any = None

    def _implements_train_batch_hooks(self) -> bool:  # tf.keras asks, to skip batch hooks nobody needs
        return False

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...

    @_unused
    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def set_model(self, model: Any) -> None:
        self.model = model

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


class LogCallback(_Callback):
    """Send epoch begin/end (and, with ``per_batch_log=True``, every batch end) with Keras' ``logs`` dict.

    Lines read ``epoch 3/10 end: loss=0.2134 accuracy=0.91``. Only rank 0 sends, unless ``all_ranks=True``
    (each rank's lines are tagged with its rank on the driver anyway). Each epoch's numeric metrics are also
    reported with ``log_metrics(epoch, ...)`` (epochs counted from 1).
    """

    def __init__(self, per_batch_log: bool = False, all_ranks: bool = False) -> None:
        super().__init__()
        self.per_batch_log = per_batch_log
        self.all_ranks = all_ranks
        self._epoch = 0

    def _implements_train_batch_hooks(self) -> bool:
        return self.per_batch_log

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
        metrics = numeric(logs)
        # as data only inside a run: outside one, log_metrics would print the line just printed again
        if metrics and (self.all_ranks or _is_rank0()) and control_pipe() is not None:
            log_metrics(epoch + 1, **metrics)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.per_batch_log:
            return
        steps = (self.params or {}).get("steps")
        of_steps = f"{batch + 1}/{steps}" if steps else str(batch + 1)
        self._send(f"epoch {self._of_epochs()} batch {of_steps} end: {_format_logs(logs)}".rstrip(": "))


class CheckpointCallback(_Callback):
    """Save the model at the end of every ``every``-th epoch on rank 0, then report it with ``report_checkpoint``.

    ``path`` may hold ``{epoch}`` (epochs counted from 1): ``"/shared/ckpt/epoch-{epoch}.keras"``. It must be
    where the next try's ranks can read it (shared storage on a cluster). The checkpoint's info is
    ``epoch`` (the epochs done), to resume with::

        ckpt = last_checkpoint()
        if ckpt:
            model = keras.models.load_model(ckpt["path"])
        model.fit(..., initial_epoch=ckpt["epoch"] if ckpt else 0, callbacks=[CheckpointCallback(path)])

    A path ending in ``.weights.h5`` saves the weights only (``model.load_weights`` then). Each save goes to a
    temporary name in the same folder, then replaces ``path`` at once: a rank killed mid-save never leaves a
    half-written file where the last checkpoint reported points.
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
        folder, name = os.path.split(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # saved beside it under a temporary name (same folder: same file system), then renamed over it: a rank
        # killed mid-save leaves the checkpoint reported before whole (the name keeps the suffix Keras checks)
        partial = os.path.join(folder, f".{os.getpid()}-partial-{name}")
        try:
            if path.endswith(".weights.h5"):
                self.model.save_weights(partial)
            else:
                self.model.save(partial)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise
        report_checkpoint(path, epoch=done)
