"""A training loop with Hugging Face's Accelerate on TorchDistributor's processes, its curve and checkpoints
reported (docs/frameworks.md).

python accelerate_loop.py OUTPUT_DIR
"""

import os
import sys

from airflow_provider_hvd import TorchDistributor


def train(output_dir: str, epochs: int = 4) -> dict:
    import torch
    from accelerate import Accelerator

    from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # without cpu=True, each process trains alone
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1)), batch_size=16, shuffle=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    first_epoch = 0
    checkpoint = last_checkpoint()  # None: from the start
    if checkpoint is not None:
        accelerator.load_state(checkpoint["path"])
        first_epoch = checkpoint["epoch"]
    for epoch in range(first_epoch, epochs):
        for x_batch, y_batch in data:
            loss = torch.nn.functional.mse_loss(model(x_batch).squeeze(1), y_batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        loss = accelerator.reduce(loss.detach(), "mean")
        path = os.path.join(output_dir, f"epoch-{epoch + 1}")
        accelerator.save_state(path)  # each process writes its part
        accelerator.wait_for_everyone()  # the folder is whole
        if accelerator.is_main_process:
            log_metrics(epoch + 1, loss=loss)
            report_checkpoint(path, epoch=epoch + 1)
    return {"epochs": epochs, "processes": accelerator.num_processes}


if __name__ == "__main__":
    runner = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    print(runner.run(train, sys.argv[1]))  # {'epochs': 4, 'processes': 2}
    print("loss by epoch:", runner.metrics["loss"])
    print("last checkpoint:", runner.checkpoint["path"])  # .../epoch-4
