"""Lightning in the ranks: :class:`ReportCallback` sends its curves and checkpoints to the driver.

::

    from airflow_provider_hvd.integrations.lightning import ReportCallback, last_checkpoint_path

    trainer = lightning.Trainer(accelerator="cpu", strategy="ddp", callbacks=[ReportCallback()], ...)
    trainer.fit(model, data, ckpt_path=last_checkpoint_path())  # None on a first try: from the start

Lightning detects the run's processes itself (``TorchElasticEnvironment``: each one gets ``torchrun``'s
variables). For ``lightning.pytorch`` (the ``lightning`` package; the ``lightning`` extra), not the separate
``pytorch_lightning`` package.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from airflow_provider_hvd.integrations import last_checkpoint_path, same, send_metrics
from airflow_provider_hvd.runner.rank.progress import numeric, report_checkpoint

__all__ = ["ReportCallback", "last_checkpoint_path"]


class ReportCallback(pl.Callback):
    """Sends rank 0's ``trainer.callback_metrics`` with ``log_metrics(global_step, ...)``, and each checkpoint a
    ``ModelCheckpoint`` saves with ``report_checkpoint(path, step=..., epoch=...)``.

    Metrics: at Lightning's logging interval (``Trainer(log_every_n_steps=...)``) those logged in training steps;
    at the end of each validation and each training epoch those with new values (validation and epoch metrics).
    A metric logged with both ``on_step`` and ``on_epoch`` goes by Lightning's names for them (``loss_step``,
    ``loss_epoch``), as Lightning's own loggers get it. Checkpoints: each file once ``trainer.save_checkpoint``
    has returned on every process (it is whole), reported at the next hook of this callback (the next batch,
    epoch or the end of training: checkpoint callbacks run after the others). A retry resumes from it with
    ``trainer.fit(model, ..., ckpt_path=last_checkpoint_path())``: the step count, the loops and the curve go on
    from there.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sent: dict[str, float] = {}  # the last value sent of each metric
        self._stepwise: set[str] = set()  # the metrics sent at the last logging interval
        self._last_interval = -1
        self._saved: dict[int, tuple[str, int]] = {}  # each checkpoint callback's last file (and step) reported
        self._epoch_of: dict[int, int] = {}  # the epoch of each step a checkpoint was saved at

    # -- metrics

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        metrics = numeric(trainer.callback_metrics)
        return {
            name: value
            for name, value in metrics.items()
            if f"{name}_step" not in metrics and f"{name}_epoch" not in metrics  # (Lightning's alias of one of them)
        }

    def _send(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if metrics:
            send_metrics(trainer.global_step, metrics)
            self._sent.update(metrics)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        interval = getattr(trainer, "log_every_n_steps", 50)  # (set by Trainer(log_every_n_steps=...), 50 by default)
        if not trainer.is_global_zero or not interval or step % interval or step == self._last_interval:
            return
        self._last_interval = step  # once per optimizer step (gradient accumulation ends several batches here)
        metrics = self._metrics(trainer)
        # a metric sent at the last interval goes on (a constant learning rate too); a validation or epoch
        # metric, unchanged since it was sent, does not come back at every step
        sent = {n: v for n, v in metrics.items() if n in self._stepwise or not same(self._sent.get(n), v)}
        self._stepwise = set(sent)
        self._send(trainer, sent)

    def _send_new_values(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            self._send(trainer, {n: v for n, v in self._metrics(trainer).items() if not same(self._sent.get(n), v)})

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._send_new_values(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._send_new_values(trainer)

    # -- checkpoints

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._epoch_of[int(checkpoint.get("global_step", trainer.global_step))] = int(
            checkpoint.get("epoch", trainer.current_epoch)
        )

    def _latest(self, trainer: pl.Trainer) -> dict[int, tuple[str, int]]:
        """Each checkpoint callback's last file written whole, and the step it was saved at."""
        # ModelCheckpoint keeps them from the end of trainer.save_checkpoint (after its barrier): no public name
        return {
            id(callback): (path, int(getattr(callback, "_last_global_step_saved", 0)))
            for callback in trainer.checkpoint_callbacks
            if (path := getattr(callback, "_last_checkpoint_saved", ""))
        }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._saved = self._latest(trainer)  # (what a resumed ModelCheckpoint holds was reported before)
        unknown = [
            type(callback).__name__
            for callback in trainer.checkpoint_callbacks
            if isinstance(callback, ModelCheckpoint) and not hasattr(callback, "_last_checkpoint_saved")
        ]
        if unknown and trainer.is_global_zero:
            warnings.warn(
                f"ReportCallback cannot tell which file {unknown[0]} saved last in this version of Lightning: no "
                "checkpoint will be reported; report them with report_checkpoint(path)",
                stacklevel=1,
            )

    def _report_saved(self, trainer: pl.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        for key, (path, step) in self._latest(trainer).items():
            if self._saved.get(key) != (path, step):
                self._saved[key] = (path, step)
                epoch = self._epoch_of.get(step, trainer.current_epoch)
                report_checkpoint(os.path.abspath(path), step=step, epoch=epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._report_saved(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_saved(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_saved(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_saved(trainer)
