"""Functions the restart tests run on the ranks (this module is not installed: it travels by value)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def train_until_killed(
    ckpt_dir: str,
    pid_dir: str,
    kind: str = "horovod",
    epochs: int = 5,
    kill_after_epoch: int = 0,
    seed: int = 7,
    shard: bool = False,
    gate: str = "",
) -> dict:
    """A small classifier on 2 ranks (``kind``: Horovod's DistributedOptimizer, or torch DDP over gloo), SGD with
    momentum, resumable from ``last_checkpoint()``: rank 0 saves the model and optimizer state after every epoch
    and reports it. With ``kill_after_epoch``, rank 1 SIGKILLs its own process once rank 0 has reported that
    epoch's checkpoint, in an attempt that did not resume from it. Same seed, same data: the final weights of a
    resumed run are those of a run that never failed, bit for bit.

    Each rank records its pid as ``from-<epoch resumed from>-rank-<rank>.pid`` (and, with ``shard``, the file its
    DataFrame shard is, as ``/proc`` names it); rank 0 of an attempt that resumed says which ranks of the attempts
    before it were still alive when it started. With ``gate``, the ranks of an attempt that resumed wait until
    that file exists before they train on (5 minutes at most).
    """
    import hashlib
    import signal

    import psutil
    import torch

    from airflow_provider_hvd import last_checkpoint, log_metrics, report_checkpoint

    if kind == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def allgather(value: object) -> list:
            return hvd.allgather_object(value)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def allgather(value: object) -> list:
            gathered: list = [None] * size
            dist.all_gather_object(gathered, value)
            return gathered

    checkpoint = last_checkpoint()
    start = checkpoint["epoch"] if checkpoint else 0
    Path(pid_dir, f"from-{start}-rank-{rank}.pid").write_text(str(os.getpid()))
    earlier = [int(p.read_text()) for p in Path(pid_dir).glob("from-*.pid") if not p.name.startswith(f"from-{start}-")]
    earlier_alive = [pid for pid in earlier if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    deadline = time.monotonic() + 300
    while gate and checkpoint is not None and not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    rows = None
    if shard:
        from airflow_provider_hvd import dataframe_shard

        mine = dataframe_shard()
        Path(pid_dir, f"from-{start}-rank-{rank}.shard").write_text(os.readlink(mine.info.path))
        rows = sorted(int(i) for batch in mine.iter_batches(1024) for i in batch["id"])

    data = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (512,), generator=data).float()
    features = torch.randn(512, 8, generator=data) + labels[:, None]
    x, y = features[rank::size], labels[rank::size]
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if kind == "horovod":
        model = net
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), named_parameters=net.named_parameters()
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if checkpoint is not None:
        state = torch.load(checkpoint["path"])
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if kind == "horovod":
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    trained = []
    for epoch in range(start + 1, epochs + 1):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for batch in order.split(32):
            optimizer.zero_grad()
            loss = loss_fn(model(x[batch]).squeeze(1), y[batch])
            loss.backward()
            optimizer.step()
        trained.append(epoch)
        if rank == 0:
            log_metrics(epoch, loss=loss.item())
            path = os.path.join(ckpt_dir, f"epoch-{epoch}.pt")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path + ".tmp")
            os.replace(path + ".tmp", path)  # whole or absent
            report_checkpoint(path, epoch=epoch)
        allgather(epoch)  # rank 1 goes on once rank 0 has reported
        print(f"epoch {epoch} done", flush=True)
        if epoch == kill_after_epoch and start < kill_after_epoch and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    every_row = sorted(i for part in allgather(rows) for i in part) if shard else None
    if kind != "horovod":
        dist.destroy_process_group()
    return {
        "resumed_from": checkpoint,
        "epochs_trained": trained,
        "weights_sha256": digest,
        "earlier_alive": earlier_alive,
        "rows": every_row,
    }


def fail_each_attempt(pid_dir: str, how: str = "raise", rank_that_fails: int = 1) -> None:
    """Rank ``rank_that_fails`` fails at once (``raise``: a ValueError; ``kill``: SIGKILL), every attempt; the
    other ranks wait to be ended. Each rank records its pid as ``<n>-rank-<rank>.pid``, n counting its attempts."""
    import signal

    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
    attempt = 1 + len(list(Path(pid_dir).glob(f"*-rank-{rank}.pid")))
    Path(pid_dir, f"{attempt}-rank-{rank}.pid").write_text(str(os.getpid()))
    if rank == rank_that_fails:
        print(f"attempt {attempt} fails", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"boom in attempt {attempt}")
    time.sleep(120)
