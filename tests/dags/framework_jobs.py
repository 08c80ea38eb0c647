"""Hugging Face's Trainer and Lightning on the ranks, with the provider's callbacks, for tests/test_frameworks.py and
the DAG ``frameworks_resume`` beside this file (a helper module beside the DAG file: it travels by value).

Tiny models built from their configs (nothing downloaded), on the CPU. Each run resumes from
``last_checkpoint_path()`` when there is one; with ``kill_at_step``, a run that starts afresh has rank 0 killed
(SIGKILL) at that step, after the checkpoint before it was reported: what a lost executor does to a try.
"""

from __future__ import annotations

import os
import signal

MAX_STEPS = 12
LOG_EVERY = 2  # steps
SAVE_EVERY = 4  # steps


def _kill_rank_0() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hf_train(output_dir: str, kill_at_step: int = 0) -> dict:
    """A 1-layer GPT-2 trained by ``Trainer`` for MAX_STEPS steps of 8 sequences (4 per process, 2 processes),
    checkpointing every SAVE_EVERY steps; rank 0's logged loss by step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from airflow_provider_hvd.integrations.transformers import ReportCallback, last_checkpoint_path

    resume = last_checkpoint_path()

    class KillAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if kill_at_step and resume is None and state.global_step == kill_at_step and state.is_world_process_zero:
                _kill_rank_0()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,  # on a host without GPUs: else each process trains alone (docs/frameworks.md)
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        logging_steps=LOG_EVERY,
        save_steps=SAVE_EVERY,
        ddp_find_unused_parameters=False,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": ids, "labels": ids} for ids in tokens],
        callbacks=[ReportCallback(), KillAt()],
    )
    trainer.train(resume_from_checkpoint=resume)
    return {
        "global_step": trainer.state.global_step,
        "world_size": args.world_size,
        "resumed_from": resume,
        "loss": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
    }


def lightning_train(root: str, kill_at_step: int = 0) -> dict:
    """A linear regression trained by Lightning's DDP for MAX_STEPS steps, validated every SAVE_EVERY steps and
    checkpointed every SAVE_EVERY steps; rank 0's step count and its metrics' names."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from airflow_provider_hvd.integrations.lightning import ReportCallback, last_checkpoint_path

    resume = last_checkpoint_path()

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class KillAt(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if kill_at_step and resume is None and trainer.global_step == kill_at_step and trainer.is_global_zero:
                _kill_rank_0()

    pl.seed_everything(0, verbose=False)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(2))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # the processes of this host, and the hosts (Spark tasks)
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        max_steps=MAX_STEPS,
        log_every_n_steps=LOG_EVERY,
        val_check_interval=SAVE_EVERY,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ReportCallback(),
            ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), every_n_train_steps=SAVE_EVERY, save_top_k=-1),
            KillAt(),
        ],
    )
    trainer.fit(
        Regression(),
        torch.utils.data.DataLoader(data, batch_size=8),
        torch.utils.data.DataLoader(data, batch_size=64),
        ckpt_path=resume,
    )
    return {"global_step": trainer.global_step, "world_size": trainer.world_size, "resumed_from": resume}
