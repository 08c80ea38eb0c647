"""DAGs of the long-run tests (tests/test_long_runs_deployment.py): progress as data, resume on retry."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG(
    "hvd_resume",
    schedule=None,
    start_date=START,
    catchup=False,
    params={"ckpt_dir": "", "fail_after_epoch": 0, "epochs": 6, "epoch_pause_s": 0.0},
):

    @task.horovod(np=2, retries=1, retry_delay=timedelta(seconds=1))
    def train(ckpt_dir: str, fail_after_epoch: str, epochs: str, epoch_pause_s: str, try_number: str) -> dict:
        """SGD with momentum on 2 ranks; rank 0 checkpoints every epoch. On the first try, every rank fails once the
        checkpoint of epoch ``fail_after_epoch`` is reported; the retry resumes from it."""
        import hashlib
        import os
        import time

        import horovod.torch as hvd
        import torch

        from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

        hvd.init()
        data = torch.Generator().manual_seed(7)
        labels = torch.randint(0, 2, (1024,), generator=data).float()
        features = torch.randn(1024, 8, generator=data) + labels[:, None]
        x, y = features[hvd.rank() :: hvd.size()], labels[hvd.rank() :: hvd.size()]
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
        )
        start = 0
        checkpoint = last_checkpoint()
        if checkpoint is not None:
            state = torch.load(checkpoint["path"])
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = checkpoint["epoch"]
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        trained = []
        for epoch in range(start + 1, int(epochs) + 1):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(7000 + epoch))
            for batch in order.split(32):
                optimizer.zero_grad()
                loss_fn(model(x[batch]).squeeze(1), y[batch]).backward()
                optimizer.step()
            with torch.no_grad():
                logits = model(x).squeeze(1)
                loss = hvd.allreduce(loss_fn(logits, y), name="loss").item()
                accuracy = hvd.allreduce(((logits > 0).float() == y).float().mean(), name="accuracy").item()
            trained.append(epoch)
            if hvd.rank() == 0:
                log_metrics(epoch, loss=loss, accuracy=accuracy)
                path = os.path.join(ckpt_dir, f"epoch-{epoch}.pt")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path + ".tmp")
                os.replace(path + ".tmp", path)
                report_checkpoint(path, epoch=epoch)
            hvd.allreduce(torch.zeros(1), name=f"saved-{epoch}")  # rank 1 goes on once rank 0 has reported
            if int(try_number) == 1 and epoch == int(fail_after_epoch):  # on every rank
                raise RuntimeError(f"simulated failure after epoch {epoch}")
            time.sleep(float(epoch_pause_s))  # a slower run, to watch it live
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        return {"resumed_from": checkpoint, "epochs_trained": trained, "weights_sha256": digest}

    train(
        ckpt_dir="{{ params.ckpt_dir }}",
        fail_after_epoch="{{ params.fail_after_epoch }}",
        epochs="{{ params.epochs }}",
        epoch_pause_s="{{ params.epoch_pause_s }}",
        try_number="{{ ti.try_number }}",
    )
