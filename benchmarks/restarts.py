"""A killed rank's cost: the time from the kill to the resumed attempt's first training step, side by side.

The same trivial job everywhere: a 2-rank torch DDP over gloo (a linear model, 10 steps an epoch) that
checkpoints after every epoch and resumes from its last checkpoint; in the first attempt rank 1 SIGKILLs itself
once epoch 3's checkpoint is reported. After a warm-up round, each round measures, on this host's clock, from
the kill to the resumed rank 0's first step, and which epoch it resumed from (3: the last reported checkpoint
was not lost).

``ours, local[2]``
    ``TorchDistributor(num_processes=2, local_mode=False, max_restarts=1)`` on a ``local[2]`` session.
``ours, local``
    ``TorchDistributor(num_processes=2, local_mode=True, max_restarts=1)``.
``retry loop, local[2]``
    What a user does today without ``max_restarts``: catch the run's error and call ``run()`` again with
    ``resume_from=runner.checkpoint``.
``Airflow retry``
    ``TorchDistributorOperator(num_processes=2, local_mode=True, retries=1, retry_delay=timedelta(0))`` on the
    real deployment (``airflow standalone`` on PostgreSQL, as tests/test_airflow_deployment.py starts it): the
    failed try, the scheduler's retry, a new task process; ``last_checkpoint()`` from the task state store. Its
    rounds run after the others' (one deployment for all); ``--no-airflow`` leaves it out.
``Ray Train``
    Ray Train 2.60's ``TorchTrainer`` with ``FailureConfig(max_failures=1)`` on a local Ray, in the venv
    ``.venv-ray`` (``make .venv-ray``; left out, saying why, where it is absent).

For ours, where the time goes: from the kill to the run's "restart 1 of 1" line (the failure named, the
attempt's ranks and Spark job ended) and from there to the first step (a new launch: processes, ``import
torch``, the rendezvous); and the cold ``import torch`` a warm spare rank process would have done already.

Run it from the repository root (``make bench`` runs it, with the Ray venv made first)::

    .venv/bin/python benchmarks/restarts.py --repeats 3 --json /tmp/restarts.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import inspect  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from rounds import benchmark_parser, markdown_table, quiet_logging, shown, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RAY_VENV = ROOT / ".venv-ray"
EPOCHS, KILL_AFTER = 5, 3
LABELS = {
    "ours_spark": "ours, local[2] (max_restarts=1)",
    "ours_local": "ours, local processes (max_restarts=1)",
    "retry_loop": "retry loop around run(), local[2]",
    "airflow": "Airflow retry (retry_delay=0), local processes",
    "ray": "Ray Train 2.60, FailureConfig(max_failures=1)",
}


def ddp_epochs(ckpt_dir: str, marks: str, epochs: int = EPOCHS, kill_after: int = KILL_AFTER) -> int:
    """The benchmark's job (on each rank): see the module's docstring. Returns the epoch it resumed from."""
    import os
    import signal
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from airflow_provider_hvd import last_checkpoint, report_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpoint = last_checkpoint()
    start = 0 if checkpoint is None else int(checkpoint["epoch"])
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 1)
    if checkpoint is not None:
        net.load_state_dict(torch.load(checkpoint["path"]))
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(320, 32, generator=torch.Generator().manual_seed(rank))
    for epoch in range(start + 1, epochs + 1):
        for step, batch in enumerate(data.split(32)):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
            if checkpoint is not None and epoch == start + 1 and step == 0 and rank == 0:
                Path(marks, "resumed").write_text(f"{time.time()} {start}")
        if rank == 0:
            path = Path(ckpt_dir, f"epoch-{epoch}.pt")
            torch.save(net.state_dict(), f"{path}.tmp")
            os.replace(f"{path}.tmp", path)
            report_checkpoint(str(path), epoch=epoch)
        dist.barrier()  # rank 1 goes on once rank 0 has reported
        if epoch == kill_after and checkpoint is None and rank == 1:
            Path(marks, "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return start


class _RestartLine(logging.Handler):
    """When the run said its restart (``record.created``)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and "restart 1 of 1" in record.getMessage():
            self.at = record.created


def _marks(marks: Path) -> tuple[float, float, int]:
    killed = float((marks / "killed").read_text())
    resumed, start = (marks / "resumed").read_text().split()
    return killed, float(resumed), int(start)


def one_round(name: str, scratch: Path) -> dict[str, Any]:
    """One kill and resume with ``name``'s way: seconds from the kill to the first step, the epoch resumed from,
    and (ours) seconds from the kill to the restart's line."""
    from airflow_provider_hvd import HorovodRunnerError, TorchDistributor

    ckpt, marks = Path(tempfile.mkdtemp(dir=scratch)), Path(tempfile.mkdtemp(dir=scratch))
    line = _RestartLine()
    logging.getLogger("airflow_provider_hvd.runner").addHandler(line)
    try:
        local = name == "ours_local"
        if name == "retry_loop":
            runner = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
            try:
                runner.run(ddp_epochs, str(ckpt), str(marks))
            except HorovodRunnerError:
                line.at = time.time()
            again = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, resume_from=runner.checkpoint)
            again.run(ddp_epochs, str(ckpt), str(marks))
        else:
            runner = TorchDistributor(num_processes=2, local_mode=local, use_gpu=False, max_restarts=1)
            runner.run(ddp_epochs, str(ckpt), str(marks))
    finally:
        logging.getLogger("airflow_provider_hvd.runner").removeHandler(line)
    killed, resumed, start = _marks(marks)
    return {
        "kill_to_step_s": resumed - killed,
        "kill_to_restart_s": None if line.at is None else line.at - killed,
        "resumed_from_epoch": start,
    }


RAY_JOB = textwrap.dedent(
    """
    import os, signal, sys, tempfile, time
    from pathlib import Path

    import ray, torch
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks, storage, epochs, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def loop(config):
        rank = ray.train.get_context().get_world_rank()
        checkpoint = ray.train.get_checkpoint()
        start = 0
        torch.manual_seed(0)
        net = torch.nn.Linear(32, 1)
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                state = torch.load(os.path.join(folder, "model.pt"))
                start = int(open(os.path.join(folder, "epoch")).read())
            net.load_state_dict(state)
        model = ray.train.torch.prepare_model(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(320, 32, generator=torch.Generator().manual_seed(rank))
        first_attempt = not Path(marks, "killed").exists()
        for epoch in range(start + 1, epochs + 1):
            for step, batch in enumerate(data.split(32)):
                optimizer.zero_grad()
                model(batch).square().mean().backward()
                optimizer.step()
                if not first_attempt and epoch == start + 1 and step == 0 and rank == 0:
                    Path(marks, "resumed").write_text(f"{time.time()} {start}")
            with tempfile.TemporaryDirectory() as folder:
                saved = None
                if rank == 0:
                    torch.save(net.state_dict(), os.path.join(folder, "model.pt"))
                    Path(folder, "epoch").write_text(str(epoch))
                    saved = Checkpoint.from_directory(folder)
                ray.train.report({"epoch": epoch}, checkpoint=saved)
            if epoch == kill_after and first_attempt and rank == 1:
                Path(marks, "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=storage, failure_config=FailureConfig(max_failures=1)),
    )
    trainer.fit()
    ray.shutdown()
    """
)


def ray_missing(venv: Path = RAY_VENV) -> str | None:
    """Why the Ray peer cannot run (None: it can)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no {venv} (make .venv-ray installs Ray Train 2.60 and a CPU torch there)"
    return None


def ray_round(scratch: Path, venv: Path = RAY_VENV) -> dict[str, Any]:
    """One kill and resume under Ray Train, in its own venv's process."""
    marks, storage = Path(tempfile.mkdtemp(dir=scratch)), Path(tempfile.mkdtemp(dir=scratch))
    script = scratch / "ray_job.py"
    script.write_text(RAY_JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON")}
    args = [str(venv / "bin" / "python"), str(script), str(marks), str(storage), str(EPOCHS), str(KILL_AFTER)]
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    killed, resumed, start = _marks(marks)
    return {"kill_to_step_s": resumed - killed, "kill_to_restart_s": None, "resumed_from_epoch": start}


DAG_FILE = """
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

EPOCHS, KILL_AFTER = {epochs}, {kill_after}

{job}

with DAG("restart_by_retry", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False):
    TorchDistributorOperator(
        task_id="train",
        python_callable=ddp_epochs,
        op_kwargs={{"ckpt_dir": "{{{{ dag_run.conf['ckpt_dir'] }}}}", "marks": "{{{{ dag_run.conf['marks'] }}}}"}},
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        retries=1,
        retry_delay=timedelta(0),
    )
"""


def airflow_rounds(repeats: int, scratch: Path) -> list[dict[str, Any]]:
    """A warm-up and ``repeats`` rounds of the Airflow retry, on one deployment started here."""
    sys.path.insert(0, str(ROOT / "tests"))  # the tests' deployment and PostgreSQL
    from airflow_deployment import AirflowDeployment
    from postgres import PostgresServer

    dags = scratch / "dags"
    dags.mkdir()
    job = inspect.getsource(ddp_epochs)
    (dags / "restart_by_retry.py").write_text(DAG_FILE.format(epochs=EPOCHS, kill_after=KILL_AFTER, job=job))
    postgres = PostgresServer().start()
    try:
        airflow = AirflowDeployment(scratch / "airflow", str(dags), postgres.create_database("bench_restarts"), {})
        try:
            airflow.start(["restart_by_retry"], timeout=300)
            runs = []
            for i in range(repeats + 1):
                ckpt, marks = Path(tempfile.mkdtemp(dir=scratch)), Path(tempfile.mkdtemp(dir=scratch))
                run_id = airflow.trigger("restart_by_retry", {"ckpt_dir": str(ckpt), "marks": str(marks)})
                state = airflow.wait_for_run("restart_by_retry", run_id, timeout=300)
                if state != "success":
                    raise RuntimeError(f"the DAG run ended {state}:\n{airflow.log_tail()}")
                killed, resumed, start = _marks(marks)
                figures = {"kill_to_step_s": resumed - killed, "kill_to_restart_s": None, "resumed_from_epoch": start}
                print(f"airflow {i}/{repeats}: {figures}", file=sys.stderr, flush=True)
                if i:
                    runs.append(figures)
            return runs
        finally:
            airflow.stop()
    finally:
        postgres.stop()


def import_torch_s() -> float:
    """A cold ``import torch`` in a new process: what a warm spare rank process would have behind it."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def figures_of(rounds: dict[str, list[dict[str, Any]]], errors: dict[str, str]) -> dict[str, Any]:
    """Per method: each round's figures and their medians (the step's, the restart line's, the epochs resumed
    from), or the reason it was left out."""
    figures: dict[str, Any] = {}
    for name, label in LABELS.items():
        runs = rounds.get(name, [])
        lines = [run["kill_to_restart_s"] for run in runs]
        figures[name] = {
            "label": label,
            "rounds": runs,
            "median_kill_to_step_s": round(statistics.median(r["kill_to_step_s"] for r in runs), 2) if runs else None,
            "median_kill_to_restart_s": round(statistics.median(lines), 2) if runs and None not in lines else None,
            "resumed_from_epochs": sorted({r["resumed_from_epoch"] for r in runs}),
            "left_out": errors.get(name),
        }
    return figures


def format_table(figures: dict[str, Any]) -> str:
    """The figures as docs/benchmarks.md shows them."""
    rows = []
    for name in LABELS:
        method = figures[name]
        epochs = ", ".join(str(e) for e in method["resumed_from_epochs"]) or "n/a"
        rows.append(
            [
                method["label"],
                shown(method["median_kill_to_step_s"], unit=" s"),
                shown(method["median_kill_to_restart_s"], unit=" s"),
                epochs if method["left_out"] is None else f"left out: {method['left_out']}",
            ]
        )
    head = [
        "method",
        "kill to resumed first step (median)",
        "kill to restart said",
        f"resumed from epoch (of {KILL_AFTER})",
    ]
    return markdown_table(head, rows)


def run(methods: list[str], repeats: int, scratch: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """``repeats`` rounds of each method, round-robin; a method that fails is left out with its error."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    errors: dict[str, str] = {}
    for i in range(repeats + 1):  # round 0 warms up (Spark's first jobs, the page cache): not recorded
        for name in methods:
            if name in errors:
                continue
            try:
                figures = ray_round(scratch) if name == "ray" else one_round(name, scratch)
            except Exception as exc:  # noqa: BLE001 - reported as left out; the others go on
                errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            if i:
                rounds[name].append(figures)
            print(f"{name} {i}/{repeats}: {figures}", file=sys.stderr, flush=True)
    return rounds, errors


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, repeats=3, what="rounds per method")
    parser.add_argument("--no-ray", action="store_true", help="leave the Ray Train peer out")
    parser.add_argument("--no-airflow", action="store_true", help="leave the Airflow retry out")
    args = parser.parse_args(argv)
    quiet_logging()
    from rounds import local_spark

    methods = ["ours_spark", "ours_local", "retry_loop"]
    why_not_ray = "--no-ray" if args.no_ray else ray_missing()
    if why_not_ray is None:
        methods.append("ray")
    else:
        print(f"the Ray Train peer is left out: {why_not_ray}", file=sys.stderr)
    scratch = Path(tempfile.mkdtemp(prefix="hvd-bench-restarts-"))
    try:
        spark = local_spark(2)
        try:
            rounds, errors = run(methods, args.repeats, scratch)
        finally:
            spark.stop()
        if args.no_airflow:
            errors["airflow"] = "--no-airflow"
        else:
            try:
                rounds["airflow"] = airflow_rounds(args.repeats, scratch)
            except Exception as exc:  # noqa: BLE001 - reported as left out
                errors["airflow"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if why_not_ray is not None:
        errors["ray"] = why_not_ray
    figures = {
        "repeats": args.repeats,
        "methods": figures_of(rounds, errors),
        "import_torch_s": round(import_torch_s(), 2),
    }
    print(f"a killed rank to the resumed first step, 2-rank DDP, {args.repeats} rounds")
    print(format_table(figures["methods"]))
    print(f"a cold `import torch` in a new process: {figures['import_torch_s']:.2f} s")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
