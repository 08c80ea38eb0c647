"""Train a small torch model with DDP on a Spark Connect server, in a run that outlives the Airflow task.

On a ``spark_connect`` connection the task submits its run (durable, the default): the run's supervisor lives
in the cluster, its id goes to the task state store, and if the worker running the task is lost (a deploy, an
evicted pod, the OOM killer) the task's retry attaches to the run still training instead of starting again;
marking the task failed still ends every rank. With ``deferrable=True`` the task also frees its worker slot
while the run trains (the triggerer holds the run's link). The server needs one task slot more than the ranks
(the run's host). See docs/durable-runs.md.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task


def train(epochs: int = 6, lr: float = 0.05) -> dict:
    """Two Gaussian blobs in 8 dimensions, made the same on every rank; each trains on its half, DDP averages."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_hvd import log_metrics, log_to_driver

    dist.init_process_group("gloo")  # torchrun's environment: no arguments needed
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 2, (4096,), generator=generator).float()
    features = torch.randn(4096, 8, generator=generator) + labels[:, None] * 1.5
    x, y = features[rank::size], labels[rank::size]
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * size)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    loss = accuracy = float("nan")
    for epoch in range(epochs):
        for batch in torch.arange(len(x)).split(64):
            optimizer.zero_grad()
            loss_fn(model(x[batch]).squeeze(1), y[batch]).backward()
            optimizer.step()
        with torch.no_grad():
            logits = model.module(x).squeeze(1)
            figures = torch.stack([loss_fn(logits, y), ((logits > 0).float() == y).float().mean()])
            dist.all_reduce(figures)
            loss, accuracy = (figures / size).tolist()
        if rank == 0:
            log_to_driver(f"epoch {epoch + 1}/{epochs}: loss={loss:.4f} accuracy={accuracy:.3f}")
            log_metrics(epoch + 1, loss=loss, accuracy=accuracy)  # the Training tab's curves
    dist.destroy_process_group()
    return {"loss": round(loss, 4), "accuracy": round(accuracy, 4), "epochs": epochs, "ranks": size}


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torch", "example", "spark-connect"],
    params={"epochs": Param(6, type="integer", minimum=1, description="training epochs")},
    render_template_as_native_obj=True,
)
def torch_durable_example():
    # durable: the default on a spark_connect connection; add deferrable=True to free the worker slot meanwhile
    trained = task.torch_distributed(
        train, num_processes=2, local_mode=False, use_gpu=False, conn_id="spark_connect_default", retries=2
    )

    @task
    def report(metrics: dict) -> None:
        print(f"rank 0 result: {metrics}")
        if metrics["accuracy"] < 0.8:
            raise ValueError(f"the model did not learn: {metrics}")

    report(trained(epochs="{{ params.epochs }}"))


torch_durable_example()
