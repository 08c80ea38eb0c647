"""FSDP2 (torch's fully_shard) on TorchDistributor's processes, checkpointed with torch.distributed.checkpoint and
resumed from it (docs/frameworks.md).

python fsdp2.py CHECKPOINT_DIR
"""

import os
import sys

from airflow_provider_hvd import TorchDistributor


def train(checkpoint_dir: str, epochs: int = 4) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun's variables: no arguments
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # each process holds a shard of every parameter
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    first_epoch = 0
    checkpoint = last_checkpoint()  # None: from the start
    if checkpoint is not None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=checkpoint["path"])  # each process reads its shards
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        first_epoch = checkpoint["epoch"]
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    for epoch in range(first_epoch, epochs):
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x.sum(dim=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        path = os.path.join(checkpoint_dir, f"epoch-{epoch + 1}")
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # returns once whole
        if dist.get_rank() == 0:
            log_metrics(epoch + 1, loss=loss)
            report_checkpoint(path, epoch=epoch + 1)
    dist.destroy_process_group()
    return {"epochs": epochs}


if __name__ == "__main__":
    runner = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    print(runner.run(train, sys.argv[1]))  # {'epochs': 4}
    print("loss by epoch:", runner.metrics["loss"])
    print("last checkpoint:", runner.checkpoint["path"])  # .../epoch-4
