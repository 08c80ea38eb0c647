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
