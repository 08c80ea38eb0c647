"""Lightning's DDP on TorchDistributor's processes, its curve and checkpoints reported (docs/frameworks.md).

python lightning_ddp.py ROOT_DIR
"""

import os
import sys

from airflow_provider_hvd import TorchDistributor


def train(root_dir: str) -> dict:
    import lightning.pytorch as pl
    import torch

    from airflow_provider_hvd.integrations.lightning import ReportCallback, last_checkpoint_path

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1)), batch_size=16)
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        strategy="ddp",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # the processes on this host
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),  # the hosts (on Spark: the tasks)
        max_epochs=2,
        log_every_n_steps=4,
        default_root_dir=root_dir,  # on a cluster: storage that every host reads (a retry resumes from it)
        callbacks=[ReportCallback()],  # the curve and each ModelCheckpoint file, to the driver
        enable_progress_bar=False,
    )
    trainer.fit(Regression(), data, ckpt_path=last_checkpoint_path())  # None: from the start
    return {"steps": trainer.global_step, "processes": trainer.world_size}


if __name__ == "__main__":
    runner = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    print(runner.run(train, sys.argv[1]))  # {'steps': 32, 'processes': 2}
    print("loss by step:", runner.metrics["loss"])
    print("last checkpoint:", runner.checkpoint["path"])  # .../checkpoints/epoch=1-step=32.ckpt
