"""Functions the tests run on Horovod ranks (this module is not installed: it travels by value)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _record_pid(pid_dir: str | None, rank: int) -> None:
    if pid_dir:
        Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))


def allreduce_sum(base: float = 0.0) -> dict:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([base + hvd.rank() + 1.0]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(), "sum": total}


def train_linear(steps: int = 80, lr: float = 0.1) -> dict:
    """Fit y = 3x - 2 on per-rank shards with hvd.DistributedOptimizer; report every rank's weights."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(1000 + hvd.rank())  # different data and initial weights on each rank
    x = torch.randn(256, 1)
    y = 3 * x - 2 + 0.01 * torch.randn(256, 1)
    model = torch.nn.Linear(1, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = (model.weight.item(), model.bias.item())
    return {
        "rank": hvd.rank(),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "weights": hvd.allgather_object(params),
        "cwds": hvd.allgather_object(os.getcwd()),
    }


def fail_on_rank(bad_rank: int, pid_dir: str | None = None, how: str = "raise") -> None:
    """``bad_rank`` fails (``raise`` or ``exit``: os._exit(3)); the other ranks would run for a minute."""
    import horovod.torch as hvd

    hvd.init()
    _record_pid(pid_dir, hvd.rank())
    if hvd.rank() == bad_rank:
        print(f"rank {bad_rank} is about to fail", flush=True)
        if how == "exit":
            os._exit(3)
        raise ValueError(f"boom from rank {bad_rank}")
    time.sleep(60)


def sleep_and_record(pid_dir: str, seconds: float = 60.0) -> None:
    import horovod.torch as hvd

    hvd.init()
    _record_pid(pid_dir, hvd.rank())
    time.sleep(seconds)


def wait_for_pids(pid_dir: str, count: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(Path(pid_dir).glob("rank-*.pid"))
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise TimeoutError(f"only {len(list(Path(pid_dir).glob('rank-*.pid')))} of {count} ranks started")


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(pids: list[int], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "rank processes outlived the run"


def no_spark_job_left(spark, within: float = 10.0) -> bool:
    """No active Spark job or stage in the status tracker, within ``within`` seconds: Spark's listener bus records a
    job's end after the job's caller was woken (a failed job's, after it)."""
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + within
    while (tracker.getActiveJobsIds() or tracker.getActiveStageIds()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not tracker.getActiveJobsIds() and not tracker.getActiveStageIds()


def cancel_once_running(runner, pid_dir: str, ranks: int = 2) -> tuple[BaseException, list[int], float]:
    """Run :func:`sleep_and_record` with ``runner`` in a thread and cancel it once its ranks run (driver side).

    Returns the error ``run`` raised, the ranks' pids and the seconds from the cancel to ``run``'s end.
    """
    import threading

    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            runner.run(sleep_and_record, pid_dir=pid_dir)
        except BaseException as exc:  # noqa: BLE001 - the caller checks which
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    pids = wait_for_pids(pid_dir, ranks)
    started = time.monotonic()
    runner.cancel()
    thread.join(30)
    assert not thread.is_alive(), "run() did not end within 30 s of cancel()"
    assert "error" in outcome, "run() returned instead of raising"
    return outcome["error"], pids, time.monotonic() - started


def allreduce_until_failure(bad_rank: int, fail_at: int = 5) -> None:
    """Every rank allreduces a gradient-sized tensor in a loop; ``bad_rank`` raises at step ``fail_at``.

    The other ranks are then inside an allreduce, as in real training, and fail when Horovod shuts down.
    """
    import horovod.torch as hvd
    import torch

    hvd.init()
    grad = torch.ones(1 << 14)
    for step in range(1_000_000):
        if hvd.rank() == bad_rank and step == fail_at:
            raise ValueError(f"boom from rank {bad_rank} at step {step}")
        hvd.allreduce(grad, name="grad")


def train_until_gate(pid_dir: str, gate: str, limit: float = 300.0) -> dict:
    """Each rank appends its pid (a second start of a rank would add a line), then "trains" (a line a step)
    until the file ``gate`` exists; rank 0 returns its pid and its steps."""
    import horovod.torch as hvd

    hvd.init()
    with open(Path(pid_dir, f"rank-{hvd.rank()}.pids"), "a") as out:
        out.write(f"{os.getpid()}\n")
    _record_pid(pid_dir, hvd.rank())
    step, deadline = 0, time.monotonic() + limit
    while not Path(gate).exists() and time.monotonic() < deadline:
        print(f"rank {hvd.rank()} step {step}", flush=True)
        step += 1
        time.sleep(0.5)
    print(f"rank {hvd.rank()} passed the gate at step {step}", flush=True)
    return {"rank": hvd.rank(), "pid": os.getpid(), "steps": step}


def value_of(megabytes: int) -> bytes:
    """``megabytes`` MiB of known bytes (what ``big_value`` returns)."""
    return bytes(range(256)) * (megabytes << 12)


def big_value(megabytes: int) -> bytes | None:
    """Rank 0 returns ``value_of(megabytes)`` (a value a watcher must never download)."""
    rank = int(os.environ["HOROVOD_RANK"])
    return value_of(megabytes) if rank == 0 else None


def hold_slots_until(path: str, started: str | None = None):
    """A task that holds its slot until ``path`` exists (at most 5 minutes); with ``started``, it says it runs by
    a file of its own in that folder."""

    def task(batches):
        import os
        import time
        import uuid

        if started:
            open(os.path.join(started, uuid.uuid4().hex), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield from batches

    return task
