"""Training functions for the progress and resume tests, run by tests/test_progress.py and by the DAG
``hvd_resume`` beside it. Not installed: a helper module beside the test or DAG file, it travels by value."""

from __future__ import annotations

import os


def train_resumable(
    ckpt_dir: str,
    epochs: int = 6,
    fail_after_epoch: int = 0,
    seed: int = 7,
    epoch_pause_s: float = 0.0,
    hold_until: str = "",
) -> dict:
    """A small classifier trained on 2 ranks with SGD + momentum, resumable from ``last_checkpoint()``.

    Rank 0 saves the model and optimizer state after every epoch and reports it; with ``fail_after_epoch``,
    every rank fails once rank 0 has reported that epoch's checkpoint; ``epoch_pause_s`` slows each epoch down;
    with ``hold_until`` (a path), the ranks wait after their first epoch until that file exists (to watch a run
    live: the watcher releases it once it has seen the first epoch). Same seed, same data: the final weights of a
    resumed run match those of a run that never failed, bit for bit.
    """
    import hashlib
    import time

    import horovod.torch as hvd
    import torch

    from airflow_provider_hvd.horovod import last_checkpoint, log_metrics, report_checkpoint

    hvd.init()
    data = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (1024,), generator=data).float()
    features = torch.randn(1024, 8, generator=data) + labels[:, None]
    x, y = features[hvd.rank() :: hvd.size()], labels[hvd.rank() :: hvd.size()]
    torch.manual_seed(seed)
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
    trained, loss = [], None  # a try that resumes from the last epoch trains nothing
    for epoch in range(start + 1, epochs + 1):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
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
            os.replace(path + ".tmp", path)  # whole or absent
            report_checkpoint(path, epoch=epoch)
        hvd.allreduce(torch.zeros(1), name=f"saved-{epoch}")  # rank 1 goes on once rank 0 has reported
        if epoch == fail_after_epoch:  # every rank: which one the driver names first is not this test's point
            raise RuntimeError(f"simulated failure after epoch {epoch}")
        if hold_until and epoch == start + 1:  # until the watcher has seen this try's first epoch (10 min at most)
            given_up = time.monotonic() + 600
            while not os.path.exists(hold_until) and time.monotonic() < given_up:
                time.sleep(0.2)
        time.sleep(epoch_pause_s)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"resumed_from": checkpoint, "epochs_trained": trained, "weights_sha256": digest, "loss": loss}


def log_many_metrics(reports: int, pause_s: float = 0.0) -> int:
    """Every rank reports ``reports`` steps of two metrics (the driver keeps rank 0's)."""
    import time

    import horovod.torch as hvd

    from airflow_provider_hvd import log_metrics

    hvd.init()
    for step in range(reports):
        log_metrics(step, loss=1.0 / (step + 1) + hvd.rank(), lr=float("nan") if step == 3 else 0.1)
        if pause_s:
            time.sleep(pause_s)
    return reports


def keras_fit_resumable(path: str, epochs: int) -> dict:
    """Keras on the torch backend with LogCallback and CheckpointCallback; resumes from last_checkpoint()."""
    import keras
    import numpy as np

    from airflow_provider_hvd.horovod import last_checkpoint
    from airflow_provider_hvd.horovod.keras import CheckpointCallback, LogCallback

    checkpoint = last_checkpoint()
    if checkpoint is None:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    else:
        model = keras.models.load_model(checkpoint["path"])
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("float32")
    history = model.fit(
        x,
        y,
        epochs=epochs,
        initial_epoch=checkpoint["epoch"] if checkpoint else 0,
        batch_size=16,
        verbose=0,
        callbacks=[LogCallback(), CheckpointCallback(path)],
    )
    return {"epochs_run": [epoch + 1 for epoch in history.epoch]}
