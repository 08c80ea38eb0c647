"""Functions the tests run on torch.distributed ranks (plain torch, no Horovod; this module travels by value)."""

from __future__ import annotations

import os


def train_ddp(steps: int = 20) -> dict:
    """A seeded DDP fit on gloo (init_process_group with no arguments); rank 0's final weights and every rank's view."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # the same arithmetic under any launcher
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    views: list = [None] * dist.get_world_size()
    own = {
        "env": dict(os.environ),
        "torchelastic": dist.is_torchelastic_launched(),
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "gloo_iface": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    dist.all_gather_object(views, own)
    weights = [p.detach().clone() for p in model.module.parameters()]
    dist.destroy_process_group()
    return {"weights": weights, "views": views, "loss": loss.item()}


def environment() -> list[dict]:
    """Every process's environment, gathered over gloo (whichever process's value a runner returns, it holds all)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    envs: list = [None] * dist.get_world_size()
    dist.all_gather_object(envs, dict(os.environ))
    dist.destroy_process_group()
    return envs


def train_fsdp2(steps: int = 5) -> dict:
    """FSDP2 (fully_shard per Linear and on the model) on the CPU over gloo: each rank's loss and a DTensor's shard."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weight = model[0].weight
    losses: list = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss.item())
    shard_rows = weight.to_local().shape[0]
    dist.destroy_process_group()
    return {"losses": losses, "param_type": type(weight).__name__, "shard_rows": shard_rows, "rows": weight.shape[0]}


def fail_inside_collective(message: str = "rank 1 broke") -> None:
    """Rank 1 raises while rank 0 waits in an all_reduce it will never complete."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))  # both connected
    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: Gloo's "Connection closed by peer" once it is gone


def modules_loaded() -> dict:
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {"sum": total.item(), "horovod": sorted(name for name in sys.modules if name.startswith("horovod"))}


def gpu_view() -> dict:
    """What each process was given: CUDA_VISIBLE_DEVICES, its LOCAL_RANK, and where it runs (made-up GPUs)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    views: list = [None] * dist.get_world_size()
    own = {
        "rank": dist.get_rank(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "executor_dir": os.getcwd(),
        "pid": os.getpid(),
    }
    dist.all_gather_object(views, own)
    dist.destroy_process_group()
    return {"views": views}


def report_progress(checkpoint_dir: str) -> int:
    """log_to_driver, log_metrics and report_checkpoint from torch ranks (rank 0's are the ones kept)."""
    import torch
    import torch.distributed as dist

    from airflow_provider_hvd import last_checkpoint, log_metrics, log_to_driver, report_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    resumed = last_checkpoint()
    for step in (1, 2):
        loss = torch.tensor([float(step + rank)])
        dist.all_reduce(loss)
        log_metrics(step, loss=loss.item() / dist.get_world_size())
    log_to_driver(f"rank {rank} resumed from {resumed and resumed['path']}")
    if rank == 0:
        path = os.path.join(checkpoint_dir, "step-2.pt")
        torch.save({"step": 2}, path)
        report_checkpoint(path, step=2)
    dist.destroy_process_group()
    return rank


def hang_in_a_collective() -> None:
    """Rank 1 waits forever outside torch; rank 0 waits for it in an all_reduce."""
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        threading.Event().wait()
    dist.all_reduce(torch.ones(1))


def print_a_line() -> int:
    """Each process prints one line (plain print, no torch.distributed) and returns its rank."""
    rank = int(os.environ["RANK"])
    print(f"process {rank} of {os.environ['WORLD_SIZE']} says hello")
    return rank


def kill_myself(rank: int, signum: int) -> None:
    """Process ``rank`` sends itself ``signum`` (a signal from outside the run); the others wait for a minute."""
    import signal
    import time

    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.Signals(signum))
    time.sleep(60)


def slow_to_exit(rank: int, seconds: float = 60.0) -> int:
    """Returns at once; process ``rank``'s exit work (an atexit handler) then takes ``seconds``."""
    import atexit
    import time

    if int(os.environ["RANK"]) == rank:
        atexit.register(time.sleep, seconds)
    return int(os.environ["RANK"])
