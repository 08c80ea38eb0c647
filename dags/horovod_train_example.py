"""Prepare data, train a small torch model on 2 Horovod ranks with @task.horovod, report rank 0's metrics.

The training reports its metrics as data (``log_metrics``: the task's Training tab draws them) and a
checkpoint after each epoch (``report_checkpoint``); a retry resumes from the last one (``last_checkpoint``).
On a cluster, ``checkpoint_dir`` must be storage that every executor reads and writes (NFS, a mounted bucket).
Trigger it with the config {"epochs": 20} (or from the UI's "Trigger" form) to train longer.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["horovod", "example"],
    params={"epochs": Param(8, type="integer", minimum=1, description="training epochs")},
    render_template_as_native_obj=True,  # "{{ params.epochs }}" renders to the int itself
)
def horovod_train_example():
    @task
    def prepare_data(run_id: str | None = None) -> str:
        """Two Gaussian blobs in 8 dimensions, written where the ranks can read them (this host, for local[*])."""
        import tempfile
        from pathlib import Path

        import numpy as np

        rng = np.random.default_rng(7)
        n = 4096
        labels = rng.integers(0, 2, n)
        features = rng.normal(size=(n, 8)) + labels[:, None] * 1.5
        path = Path(tempfile.gettempdir(), "airflow-provider-hvd", f"blobs-{abs(hash(run_id))}.npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, x=features.astype("float32"), y=labels.astype("float32"))
        return str(path)

    @task.horovod(np=2, conn_id="spark_default", retries=2)
    def train(data_path: str, run_id: str, epochs: int = 8, lr: float = 0.05, checkpoint_dir: str = "") -> dict:
        """Each rank trains on its shard; gradients are averaged with Horovod's allreduce. Resumes on a retry."""
        import os
        import re
        import socket
        import tempfile

        import horovod.torch as hvd
        import numpy as np
        import torch

        from airflow_provider_hvd import last_checkpoint, log_metrics, log_to_driver, report_checkpoint

        hvd.init()
        hosts = hvd.allgather_object(socket.gethostname())  # where each rank runs, in rank order
        checkpoint_dir = checkpoint_dir or os.path.join(
            tempfile.gettempdir(), "airflow-provider-hvd", "checkpoints", re.sub(r"[^\w.-]", "_", run_id)
        )
        torch.manual_seed(hvd.rank())
        data = np.load(data_path)
        x = torch.from_numpy(data["x"])[hvd.rank() :: hvd.size()]
        y = torch.from_numpy(data["y"])[hvd.rank() :: hvd.size()]
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr * hvd.size()), named_parameters=model.named_parameters()
        )
        first_epoch = 0
        checkpoint = last_checkpoint()  # None on the first try; on a retry, the last one an earlier try reported
        if checkpoint is not None:
            state = torch.load(checkpoint["path"])
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_epoch = checkpoint["epoch"]
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        epoch_loss = accuracy = float("nan")
        for epoch in range(first_epoch, epochs):
            for batch in torch.arange(len(x)).split(64):
                optimizer.zero_grad()
                loss = loss_fn(model(x[batch]).squeeze(1), y[batch])
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                logits = model(x).squeeze(1)
                epoch_loss = hvd.allreduce(loss_fn(logits, y), name="loss").item()
                accuracy = hvd.allreduce(((logits > 0).float() == y).float().mean(), name="acc").item()
            if hvd.rank() == 0:
                log_to_driver(f"epoch {epoch + 1}/{epochs}: loss={epoch_loss:.4f} accuracy={accuracy:.3f}")
                log_metrics(epoch + 1, loss=epoch_loss, accuracy=accuracy)  # the Training tab's curves
                os.makedirs(checkpoint_dir, exist_ok=True)
                path = os.path.join(checkpoint_dir, f"epoch-{epoch + 1}.pt")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{path}.tmp")
                os.replace(f"{path}.tmp", path)  # durably written, whole: now it may be reported
                report_checkpoint(path, epoch=epoch + 1)
                if epoch > first_epoch:  # only the last one is needed to resume
                    os.remove(os.path.join(checkpoint_dir, f"epoch-{epoch}.pt"))
        return {
            "loss": round(epoch_loss, 4),
            "accuracy": round(accuracy, 4),
            "epochs": epochs,
            "ranks": hvd.size(),
            "hosts": hosts,
        }

    @task
    def report(metrics: dict) -> None:
        print(f"rank 0 result: {metrics}")
        if metrics["accuracy"] < 0.8:
            raise ValueError(f"the model did not learn: {metrics}")

    report(train(prepare_data(), epochs="{{ params.epochs }}"))


horovod_train_example()
