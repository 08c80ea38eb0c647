"""Functions the namespace-host tests run on Horovod ranks (not installed: they travel by value)."""

from __future__ import annotations


def allreduce_forever(pid_dir: str) -> None:
    """Record this rank's pid and host address, then allreduce until ended."""
    import os
    import socket
    import time
    from pathlib import Path

    import horovod.torch as hvd
    import torch

    hvd.init()
    Path(pid_dir, f"host-{hvd.rank()}").write_text(os.environ["HOROVOD_HOSTNAME"])
    Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
    print(f"rank {hvd.rank()} on {socket.gethostname()}", flush=True)
    while True:
        hvd.allreduce(torch.ones(1000), op=hvd.Sum)
        time.sleep(0.05)


def allreduce_forever_printing(pid_dir: str) -> None:
    """:func:`allreduce_forever`, with a thread printing lines as fast as it can all along (a flood of output
    for the driver to relay at ``driver_log_verbosity="all"``)."""
    import itertools
    import sys
    import threading

    def chatter() -> None:
        for i in itertools.count():
            sys.stdout.write("".join(f"chatter {i}.{j} " + "x" * 60 + "\n" for j in range(100)))
            sys.stdout.flush()

    threading.Thread(target=chatter, daemon=True).start()
    allreduce_forever(pid_dir)


def allreduce_until_preempted(pid_dir: str, epochs_after_resuming: int = 3, every_epoch: bool = False) -> dict:
    """:func:`allreduce_forever` in epochs, resumable: each rank writes the preemption notice it first sees
    (``notice-<rank>.json``); once every rank has, rank 0 saves and reports a checkpoint (``every_epoch``: after
    each epoch). An attempt that resumed from one runs ``epochs_after_resuming`` more epochs and returns what it
    ran on."""
    import json
    import os
    import time
    from pathlib import Path

    import horovod.torch as hvd
    import torch

    from airflow_provider_hvd import last_checkpoint, preemption_notice, report_checkpoint

    hvd.init()
    rank, checkpoint = hvd.rank(), last_checkpoint()
    Path(pid_dir, f"host-{rank}").write_text(os.environ["HOROVOD_HOSTNAME"])
    Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))
    start = 0 if checkpoint is None else checkpoint["epoch"]
    told = every_rank_told = False
    epoch = start
    while checkpoint is None or epoch < start + epochs_after_resuming:
        epoch += 1
        for _ in range(4):
            hvd.allreduce(torch.ones(1000), op=hvd.Sum)
            time.sleep(0.05)
        notice = None if told else preemption_notice()
        if notice is not None:
            told = True
            Path(pid_dir, f"notice-{rank}.json").write_text(json.dumps({**notice, "epoch": epoch}))
        # the attempt ends at the checkpoint: it waits for every rank to have read its notice (one may read it
        # an epoch after another), or that rank would be ended before it read it
        told_before = every_rank_told
        every_rank_told = hvd.allreduce(torch.tensor([float(told)]), op=hvd.Sum).item() == hvd.size()
        if rank == 0 and (every_epoch or (every_rank_told and not told_before)):
            path = Path(pid_dir, f"epoch-{epoch}.ckpt")
            path.write_text(str(epoch))
            report_checkpoint(str(path), epoch=epoch)
    hosts = hvd.allgather_object(os.environ["HOROVOD_HOSTNAME"])
    return {"size": hvd.size(), "resumed_from": checkpoint, "epochs": epoch - start, "hosts": hosts}


def allreduce_checkpointing(pid_dir: str) -> dict:
    """:func:`allreduce_until_preempted`, rank 0 reporting a checkpoint after every epoch."""
    return allreduce_until_preempted(pid_dir, every_epoch=True)
