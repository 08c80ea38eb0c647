"""Prepare data, train a small torch model with DDP on 2 processes with @task.torch_distributed, report rank 0's
metrics: the same training as horovod_train_example, in plain torch.distributed (no Horovod needed).

``local_mode=False`` runs the processes as a Spark barrier job on the ``spark_default`` connection's cluster;
each gets ``torchrun``'s environment, so ``init_process_group("gloo")`` needs no arguments. The metrics go to
the task's Training tab (``log_metrics``), a checkpoint after each epoch (``report_checkpoint``), and a retry
resumes from the last one (``last_checkpoint``). On a cluster, ``checkpoint_dir`` must be storage that every
executor reads and writes (NFS, a mounted bucket).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torch", "example"],
    params={"epochs": Param(8, type="integer", minimum=1, description="training epochs")},
    render_template_as_native_obj=True,  # "{{ params.epochs }}" renders to the int itself
)
def torch_ddp_example():
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
        path = Path(tempfile.gettempdir(), "airflow-provider-hvd", f"ddp-blobs-{abs(hash(run_id))}.npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, x=features.astype("float32"), y=labels.astype("float32"))
        return str(path)

    @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False, retries=2)
    def train(data_path: str, run_id: str, epochs: int = 8, lr: float = 0.05, checkpoint_dir: str = "") -> dict:
        """Each process trains on its shard; DDP averages the gradients. Resumes on a retry."""
        import os
        import re
        import socket
        import tempfile

        import numpy as np
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from airflow_provider_hvd import last_checkpoint, log_metrics, log_to_driver, report_checkpoint

        dist.init_process_group("gloo")  # MASTER_ADDR, RANK, WORLD_SIZE...: set as torchrun sets them
        rank, size = dist.get_rank(), dist.get_world_size()
        hosts: list[str] = [""] * size
        dist.all_gather_object(hosts, socket.gethostname())  # where each rank runs, in rank order
        checkpoint_dir = checkpoint_dir or os.path.join(
            tempfile.gettempdir(), "airflow-provider-hvd", "checkpoints", re.sub(r"[^\w.-]", "_", run_id)
        )
        torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        data = np.load(data_path)
        x = torch.from_numpy(data["x"])[rank::size]
        y = torch.from_numpy(data["y"])[rank::size]
        model = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * size)
        first_epoch = 0
        checkpoint = last_checkpoint()  # None on the first try; on a retry, the last one an earlier try reported
        if checkpoint is not None:
            state = torch.load(checkpoint["path"])
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_epoch = checkpoint["epoch"]
        loss_fn = torch.nn.BCEWithLogitsLoss()
        epoch_loss = accuracy = float("nan")
        for epoch in range(first_epoch, epochs):
            for batch in torch.arange(len(x)).split(64):
                optimizer.zero_grad()
                loss = loss_fn(model(x[batch]).squeeze(1), y[batch])
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                logits = model.module(x).squeeze(1)
                figures = torch.stack([loss_fn(logits, y), ((logits > 0).float() == y).float().mean()])
                dist.all_reduce(figures)
                epoch_loss, accuracy = (figures / size).tolist()
            if rank == 0:
                log_to_driver(f"epoch {epoch + 1}/{epochs}: loss={epoch_loss:.4f} accuracy={accuracy:.3f}")
                log_metrics(epoch + 1, loss=epoch_loss, accuracy=accuracy)  # the Training tab's curves
                os.makedirs(checkpoint_dir, exist_ok=True)
                path = os.path.join(checkpoint_dir, f"ddp-epoch-{epoch + 1}.pt")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, f"{path}.tmp")
                os.replace(f"{path}.tmp", path)  # durably written, whole: now it may be reported
                report_checkpoint(path, epoch=epoch + 1)
                if epoch > first_epoch:  # only the last one is needed to resume
                    os.remove(os.path.join(checkpoint_dir, f"ddp-epoch-{epoch}.pt"))
        dist.destroy_process_group()
        return {"loss": round(epoch_loss, 4), "accuracy": round(accuracy, 4), "epochs": epochs, "ranks": size,
                "hosts": hosts}  # fmt: skip

    @task
    def report(metrics: dict) -> None:
        print(f"rank 0 result: {metrics}")
        if metrics["accuracy"] < 0.8:
            raise ValueError(f"the model did not learn: {metrics}")

    report(train(prepare_data(), epochs="{{ params.epochs }}"))


torch_ddp_example()
