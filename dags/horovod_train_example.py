"""Prepare data, train a small torch model on 2 Horovod ranks with @task.horovod, report rank 0's metrics.

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

    @task.horovod(np=2, conn_id="spark_default")
    def train(data_path: str, epochs: int = 8, lr: float = 0.05) -> dict:
        """Each rank trains on its shard; gradients are averaged with Horovod's allreduce."""
        import socket

        import horovod.torch as hvd
        import numpy as np
        import torch

        from airflow_provider_hvd import log_to_driver

        hvd.init()
        hosts = hvd.allgather_object(socket.gethostname())  # where each rank runs, in rank order
        torch.manual_seed(hvd.rank())
        data = np.load(data_path)
        x = torch.from_numpy(data["x"])[hvd.rank() :: hvd.size()]
        y = torch.from_numpy(data["y"])[hvd.rank() :: hvd.size()]
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr * hvd.size()), named_parameters=model.named_parameters()
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for epoch in range(epochs):
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
        return {"loss": round(epoch_loss, 4), "accuracy": round(accuracy, 4), "epochs": epochs, "ranks": hvd.size(),
                "hosts": hosts}

    @task
    def report(metrics: dict) -> None:
        print(f"rank 0 result: {metrics}")
        if metrics["accuracy"] < 0.8:
            raise ValueError(f"the model did not learn: {metrics}")

    report(train(prepare_data(), epochs="{{ params.epochs }}"))


horovod_train_example()
