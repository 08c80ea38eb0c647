"""Train a small torch model with DDP on the rows of a Spark DataFrame: ``dataframe=`` on
``@task.torch_distributed`` (a SQL string, templated), each process reading its shard with
``dataframe_shard()``. No files written by hand, no sharded reader.

The SQL runs in the task's own Spark session (the ``spark_default`` connection's: classic or Spark Connect); in
production it would name a table (``SELECT features, label FROM training.samples``). Here it makes two Gaussian
blobs from ``range``: a label, and two features shifted by it.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task

SAMPLES = """
SELECT CAST(id % 2 AS FLOAT) AS label,
       array(CAST(randn(1) + (id % 2) * 2 AS FLOAT), CAST(randn(2) + (id % 2) * 2 AS FLOAT)) AS features
FROM range({{ params.rows }})
"""


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torch", "example", "dataframe"],
    params={"rows": Param(2048, type="integer", minimum=64, description="rows of training data")},
)
def torch_dataframe_example():
    @task.torch_distributed(num_processes=2, local_mode=False, use_gpu=False, dataframe=SAMPLES)
    def train(epochs: int = 5, batch_size: int = 64, lr: float = 0.1) -> dict:
        """Each process trains on its shard of the DataFrame's rows; DDP averages the gradients."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from airflow_provider_hvd import dataframe_shard, log_to_driver

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        shard = dataframe_shard()  # this process's rows, on the executor's local disk
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * size)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for epoch in range(epochs):
            # drop_last: every rank takes as many steps (an all-reduce each), so none waits for a missing peer
            for batch in shard.iter_torch_batches(batch_size, shuffle=True, seed=epoch, drop_last=True):
                optimizer.zero_grad()
                loss = loss_fn(model(batch["features"]).squeeze(1), batch["label"])
                loss.backward()
                optimizer.step()
        right = torch.zeros(2)  # correct predictions, rows: over the whole shard, then summed over the ranks
        with torch.no_grad():
            for batch in shard.iter_torch_batches(1024):
                guess = (model.module(batch["features"]).squeeze(1) > 0).float()
                right += torch.tensor([(guess == batch["label"]).sum().item(), len(guess)])
        dist.all_reduce(right)
        accuracy = (right[0] / right[1]).item()
        if rank == 0:
            log_to_driver(f"trained {epochs} epochs on {int(right[1])} rows: accuracy={accuracy:.3f}")
        dist.destroy_process_group()
        return {"accuracy": round(accuracy, 4), "rows": int(right[1]), "shard_rows": shard.num_rows, "ranks": size}

    train()


torch_dataframe_example()
