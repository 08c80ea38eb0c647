"""TorchDistributor side by side with PySpark's and with bare ``torchrun``: launch, training tax, a failing rank.

All on one warm ``local[2]`` SparkSession, in one run (the ratios are what to compare):

Launch of a trivial 2-process job (``init_process_group("gloo")``, one ``all_reduce``, return the rank):

``ours``
    ``airflow_provider_hvd.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(trivial)``.
``pyspark``
    ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)``.
``floor``
    ``torchrun --standalone --nproc-per-node 2`` on a file doing the same, no Spark: the cost any launcher pays.

Training tax: the same seeded DDP MLP (``--steps`` steps on 2 processes), the training loop timed inside
rank 0 (launch excluded), ``--train-repeats`` rounds interleaved; ours' steps per second over ``torchrun``'s
(goal >= 0.95); ``ours_local`` is ours with ``local_mode=True`` (no Spark on the machine's cores).

A failing rank: rank 1 raises while rank 0 waits in an ``all_reduce``; what ``run()`` raises in each (its
type, its length, whether it holds the rank's own message, its first line).

Each launch method gets one untimed warm-up, then ``--repeats`` timed runs interleaved round-robin.
Run it from the repository root (a method that cannot run is reported as n/a with its reason, and the exit
status is 1; ``--check``: one run of each, no warm-up, to see that)::

    .venv/bin/python benchmarks/torch_launch.py --repeats 4 --json /tmp/torch_launch.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's default for several processes: the same on every side

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import rounds  # noqa: E402

NUM_PROC = 2
RATIOS = (("ours", "pyspark"), ("ours", "floor"), ("pyspark", "floor"))  # medians compared (where both ran)
DIGITS = 3  # the seconds' decimals in the JSON
FAILURE_MESSAGE = "rank 1 cannot read shard 7 of the training data"


def trivial() -> int:
    """The launch job: join the group, one all_reduce, return the rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def train_mlp(steps: int) -> dict[str, float]:
    """The same seeded DDP MLP everywhere; rank 0 returns the training loop's seconds and the last loss."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(steps, 64, 64, generator=data), torch.randn(steps, 64, 1, generator=data)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[step]), targets[step])
        loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"seconds": seconds, "loss": loss.item()}


def failing() -> None:
    """Rank 1 fails after joining; rank 0 is inside a collective when it does."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError(FAILURE_MESSAGE)
    dist.all_reduce(torch.ones(1))


# --- the launchers -------------------------------------------------------------------------------


def ours(fn: Callable[..., Any], *args: Any, local_mode: bool = False) -> Any:
    from airflow_provider_hvd import TorchDistributor

    return TorchDistributor(num_processes=NUM_PROC, local_mode=local_mode, use_gpu=False).run(fn, *args)


def pyspark(fn: Callable[..., Any], *args: Any) -> Any:
    from pyspark.ml.torch.distributor import TorchDistributor

    return TorchDistributor(num_processes=NUM_PROC, local_mode=False, use_gpu=False).run(fn, *args)


class Torchrun:
    """``torchrun --nproc-per-node 2`` on a file that calls one of this module's functions."""

    def __init__(self, workdir: Path) -> None:
        self.script = workdir / "torchrun_job.py"
        self.result = workdir / "result.json"
        functions = "\n\n".join(inspect.getsource(fn) for fn in (trivial, train_mlp, failing))
        self.script.write_text(
            "import json, os, sys, time\n"
            f"FAILURE_MESSAGE = {FAILURE_MESSAGE!r}\n\n{functions}\n"
            "value = globals()[sys.argv[1]](*map(int, sys.argv[2:]))\n"
            f"if os.environ['RANK'] == '0':\n    open({str(self.result)!r}, 'w').write(json.dumps(value))\n"
        )

    def command(self, name: str, *args: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NUM_PROC),
            "--standalone", str(self.script), name, *map(str, args),
        ]  # fmt: skip

    def run(self, name: str, *args: int) -> Any:
        self.result.unlink(missing_ok=True)
        proc = subprocess.run(self.command(name, *args), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:  # the cause on the first line, which a figure's "n/a" shows
            errors = [line for line in proc.stderr.splitlines() if "Error" in line]
            cause = next((line for line in reversed(errors) if line.startswith("[rank")), errors[-1] if errors else "")
            raise RuntimeError(f"torchrun exited {proc.returncode}: {cause}\n{proc.stderr}")
        return json.loads(self.result.read_text())


# --- the three measurements ----------------------------------------------------------------------


def training_figures(runners: dict[str, Callable[[int], Any]], steps: int, repeats: int) -> dict[str, Any]:
    """Steps per second of the training loop (median and best of ``repeats`` rounds, interleaved round-robin
    so that the machine's load hits every method alike), and each one's over torchrun's."""
    figures: dict[str, Any] = {"steps": steps, "methods": {}}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    errors: dict[str, str] = {}
    for round_no in range(1, repeats + 1):
        for name, run in runners.items():
            if name in errors:
                continue
            try:
                results[name].append(run(steps))
            except Exception as exc:  # noqa: BLE001 - reported as n/a
                errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        print(f"training round {round_no}/{repeats} done", file=sys.stderr, flush=True)
    for name in runners:
        if name in errors or not results[name]:
            figures["methods"][name] = {"error": errors.get(name, "no result")}
            continue
        loops = [r["seconds"] for r in results[name]]
        figures["methods"][name] = {
            "steps_per_s": round(steps / statistics.median(loops), 1),
            "best_steps_per_s": round(steps / min(loops), 1),
            "loop_s": [round(t, 3) for t in loops],
            "loss": round(results[name][-1]["loss"], 6),
        }
    methods = figures["methods"]
    base = methods.get("torchrun", {})
    for name, info in methods.items():
        if name != "torchrun" and info.get("steps_per_s") and base.get("steps_per_s"):
            figures[f"{name}/torchrun"] = round(info["steps_per_s"] / base["steps_per_s"], 3)
            figures[f"{name}/torchrun (best)"] = round(info["best_steps_per_s"] / base["best_steps_per_s"], 3)
    return figures


def failure_figures(runners: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """What each raises when rank 1 fails while rank 0 is in a collective."""
    figures: dict[str, Any] = {}
    for name, run in runners.items():
        start = time.perf_counter()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the error is the figure
            text = str(exc)
            figures[name] = {
                "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "chars": len(text),
                "holds_message": FAILURE_MESSAGE in text,
                "first_line": text.strip().splitlines()[0][:200] if text.strip() else "",
                "seconds": round(time.perf_counter() - start, 2),
            }
        else:
            figures[name] = {"type": None, "note": "run() returned: the failure was not reported"}
    return figures


# --- reporting -----------------------------------------------------------------------------------


def format_report(figures: dict[str, Any]) -> str:
    launch = figures["launch"]
    warmed = "after 1 warm-up each" if figures.get("warm_up", True) else "no warm-up"
    lines = [f"launch of a trivial {NUM_PROC}-process DDP job, {figures['repeats']} repeats ({warmed})"]
    for info in launch["methods"].values():
        text = f"{info['median_s']:.2f} s median, {info['min_s']:.2f} s min" if info["median_s"] else info["error"]
        lines.append(f"  {info['label']:<58} {text}")
    lines += [f"  {name}: {rounds.shown(r, unit='x')}" for name, r in launch["ratios"].items()]
    training = figures["training"]
    lines.append(f"training: the same DDP MLP, {training['steps']} steps, loop timed in rank 0")
    for name, info in training["methods"].items():
        text = f"{info['steps_per_s']} steps/s median, {info['best_steps_per_s']} best" if "error" not in info else ""
        lines.append(f"  {name:<10} {text}{info.get('error', '')}")
    lines += [f"  {k}: {v:.3f}x" for k, v in training.items() if "/torchrun" in k]
    lines.append("a failing rank (rank 1 raises while rank 0 is in all_reduce)")
    for name, info in figures["failure"].items():
        lines.append(f"  {name:<10} {json.dumps(info)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = rounds.benchmark_parser(__doc__, repeats=4, check=True)
    parser.add_argument(
        "--steps", type=rounds.at_least_one, default=1000, help="training steps of the MLP (default 1000)"
    )
    parser.add_argument(
        "--train-repeats", type=rounds.at_least_one, default=3, help="training runs per method (default 3)"
    )
    parser.add_argument("--skip", action="append", default=[], choices=["ours", "pyspark", "floor"], help="leave out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats, train_repeats = (1, 1) if args.check else (args.repeats, args.train_repeats)
    rounds.quiet_logging()
    spark = rounds.local_spark(NUM_PROC)
    with tempfile.TemporaryDirectory(prefix="torch-launch-") as workdir:
        torchrun = Torchrun(Path(workdir))
        launchers = {
            "ours": ("TorchDistributor (this project), local_mode=False", ours),
            "pyspark": ("pyspark.ml.torch TorchDistributor, local_mode=False", pyspark),
            "floor": ("floor: torchrun --nproc-per-node 2, no Spark", None),
        }
        chosen = {name: entry for name, entry in launchers.items() if name not in args.skip}

        def launcher(name: str) -> Callable[[], object]:
            run = chosen[name][1]
            return (lambda: torchrun.run("trivial")) if run is None else (lambda: run(trivial))

        try:
            methods = [rounds.Method(name, label, launcher(name)) for name, (label, _) in chosen.items()]
            rounds.run_rounds(methods, repeats, "launch round", warm_up=not args.check)
            figures: dict[str, Any] = {
                "repeats": repeats,
                "warm_up": not args.check,
                "launch": rounds.launch_figures(methods, RATIOS, DIGITS),
            }
            trainers: dict[str, Callable[[int], Any]] = {"torchrun": lambda n: torchrun.run("train_mlp", n)}
            trainers.update({name: (lambda n, r=run: r(train_mlp, n)) for name, (_, run) in chosen.items() if run})
            if "ours" in chosen:  # the same on this host without Spark: what the Spark side costs, if anything
                trainers["ours_local"] = lambda n: ours(train_mlp, n, local_mode=True)
            figures["training"] = training_figures(trainers, args.steps, train_repeats)
            failers: dict[str, Callable[[], Any]] = {"torchrun": lambda: torchrun.run("failing")}
            failers.update({name: (lambda r=run: r(failing)) for name, (_, run) in chosen.items() if run})
            figures["failure"] = failure_figures(failers)
        finally:
            spark.stop()
    print(format_report(figures))
    rounds.write_json(args.json, figures)
    training = figures["training"]["methods"].items()
    untrained = [f"{name} (training): {info['error']}" for name, info in training if "error" in info]
    return rounds.exit_status(rounds.not_run(methods) + untrained)


if __name__ == "__main__":
    sys.exit(main())
