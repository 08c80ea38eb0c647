"""Hugging Face ``Trainer`` in the ranks: :class:`ReportCallback` sends its curves and checkpoints to the driver.

::

    from airflow_provider_hvd.integrations.transformers import ReportCallback, last_checkpoint_path

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ReportCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint_path())  # None on a first try: from the start

On a host without GPUs, give ``TrainingArguments(use_cpu=True)``: without it each process trains alone
(docs/frameworks.md). Needs ``transformers`` (the ``transformers`` extra).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from airflow_provider_hvd.integrations import last_checkpoint_path, send_metrics
from airflow_provider_hvd.runner.rank.progress import numeric, report_checkpoint

__all__ = ["ReportCallback", "last_checkpoint_path"]


class ReportCallback(TrainerCallback):
    """Sends what the ``Trainer`` logs (``on_log``: loss, learning rate, evaluation metrics...) with
    ``log_metrics(global_step, ...)``, and each checkpoint it saves (its ``checkpoint-N`` folder, once every
    process has written its part) with ``report_checkpoint(path, step=N, epoch=...)``; from the main process
    only. A retry resumes from that folder with ``trainer.train(resume_from_checkpoint=last_checkpoint_path())``:
    the step count, the optimizer, the scheduler and the curve go on from there.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sent: dict[str, tuple[int, float]] = {}  # each metric's last step and value sent

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not (state.is_world_process_zero and logs):
            return
        step = state.global_step
        # (the summary at the end of training repeats the last step's epoch)
        metrics = {n: v for n, v in numeric(logs).items() if self._sent.get(n) != (step, v)}
        if metrics:
            send_metrics(step, metrics)
            self._sent.update({name: (step, value) for name, value in metrics.items()})

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # each process writes its own part (its RNG state; a shard under FSDP) after the main process's: the
        # folder is whole once all of them are here
        if args.world_size > 1 and args.distributed_state is not None:
            args.distributed_state.wait_for_everyone()
        if not state.is_world_process_zero:
            return
        folder = os.path.abspath(os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
        if os.path.isdir(folder):  # (a hyperparameter search's trial saves under a folder of its own)
            report_checkpoint(folder, step=state.global_step, epoch=state.epoch)
