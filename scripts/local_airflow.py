"""`make airflow`: Airflow on this machine, to try the example DAGs and their Training tab in the UI.

`airflow standalone` (a scheduler with the LocalExecutor, the API server with the UI, a DAG processor, a
triggerer) with this repository's dags/, the provider's plugin (the Training tab) and:

- ``spark_default``: Spark on ``local[*]`` in each task, as `make demo`;
- ``spark_connect_default``: the local Spark Connect server of ``python -m airflow_provider_hvd.connect_server
  start`` (sc://127.0.0.1:15002), for torch_durable_example;
- its metadata database: SQLite in AIRFLOW_HOME (default: airflow_home/ in the repository, make demo's), for one
  person trying it (docs/deployment.md has a deployment's PostgreSQL);
- the UI and the REST API on 127.0.0.1 only, with a login: ``admin`` and the password Airflow generated (kept in
  AIRFLOW_HOME).

Once the DAGs are parsed it prints the URL and the login; the components' output goes to
AIRFLOW_HOME/standalone.log. Ctrl-C (or SIGTERM) stops every component and every process they started (tasks,
their Spark drivers and ranks).

    make airflow [AIRFLOW_PORT=8080]      # or: .venv/bin/python scripts/local_airflow.py [--port 8080]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from airflow_provider_hvd.interrupts import Interrupts

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
USER = "admin"
STOP_GRACE_S = 60.0  # the components' own shutdown (a running task ends its ranks) before what is left is killed


def environment(home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}  # this command's settings only
    bin_dir = str(Path(sys.executable).parent)  # standalone starts its components as `airflow ...`
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",  # the examples run only when triggered
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=f"{USER}:admin",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://{HOST}:{port}/execution/",
        # SQLite: a writer waits up to 60 s for another's lock (5 s by default: several components write at once)
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}?timeout=60",
        AIRFLOW__API__HOST=HOST,
        AIRFLOW__API__PORT=str(port),
        SPARK_LOCAL_IP=env.get("SPARK_LOCAL_IP", HOST),
        PYSPARK_PYTHON=env.get("PYSPARK_PYTHON", sys.executable),  # the executors run this venv's Python
    )
    env.setdefault("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[*]"}))
    env.setdefault(
        "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT",
        json.dumps({"conn_type": "spark_connect", "host": f"sc://{HOST}", "port": 15002}),
    )
    return env


def _request(url: str, body: dict[str, Any] | None = None, token: str = "") -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as resp:
        return json.load(resp)


def password(home: Path) -> str | None:
    """The admin's password that Airflow generated (once, on the first start) in AIRFLOW_HOME."""
    try:
        return str(json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())[USER])
    except (OSError, ValueError, KeyError):
        return None


def ready(url: str, home: Path) -> bool:
    """The scheduler and the DAG processor are healthy and the example DAGs are parsed."""
    try:
        health = _request(f"{url}/api/v2/monitor/health")
        if not all(health.get(part, {}).get("status") == "healthy" for part in ("scheduler", "dag_processor")):
            return False
        token = _request(f"{url}/auth/token", {"username": USER, "password": password(home)})["access_token"]
        parsed = {dag["dag_id"] for dag in _request(f"{url}/api/v2/dags?limit=100", token=token)["dags"]}
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return False
    return {path.stem for path in (ROOT / "dags").glob("*.py")} <= parsed


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop standalone as Ctrl-C stops it (each component gets SIGTERM), then kill what outlived STOP_GRACE_S:
    tasks' processes, their Spark JVMs and ranks (some in process groups of their own)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)
    _, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
    for left in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            left.kill()
    psutil.wait_procs(alive, timeout=10)
    proc.wait()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080, help="the UI's and REST API's port (default: 8080)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for it (default: 600)")
    args = parser.parse_args(argv)
    home = Path(os.environ.get("AIRFLOW_HOME") or ROOT / "airflow_home").resolve()
    url = f"http://{HOST}:{args.port}"
    with contextlib.suppress(OSError), socket.create_connection((HOST, args.port), timeout=1):
        print(f"port {args.port} is in use: stop what listens there, or choose another with --port", file=sys.stderr)
        return 1
    home.mkdir(parents=True, exist_ok=True)
    log = home / "standalone.log"
    print(f"starting Airflow in {home} (its output: {log})", flush=True)

    # Ctrl-C and SIGTERM stop it; set before standalone starts, which then gets SIGINT's default (an ignored
    # signal stays ignored across exec)
    interrupts = Interrupts()
    proc: subprocess.Popen[bytes] | None = None
    try:
        with interrupts.held(), open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment(home, args.port),
                cwd=home,
                start_new_session=True,  # Ctrl-C reaches this command only, which stops the components in order
            )
        deadline = time.monotonic() + args.timeout
        while not ready(url, home):
            if proc.poll() is not None or time.monotonic() > deadline:
                what = "exited" if proc.poll() is not None else f"was not ready within {args.timeout:.0f}s"
                print(f"airflow standalone {what}; the last lines of {log}:\n{log_tail(log)}", file=sys.stderr)
                stop(proc)
                return 1
            time.sleep(1)
        print(
            f"Airflow is ready at {url}  (login: {USER} / {password(home)})\n"
            f"  the example DAGs of {ROOT / 'dags'}; spark_default is local[*]\n"
            "  trigger horovod_train_example (its Trigger button), then open its run's train task: the Training tab\n"
            "  Ctrl-C stops it",
            flush=True,
        )
        proc.wait()
        print(f"airflow standalone exited; the last lines of {log}:\n{log_tail(log)}", file=sys.stderr)
        stop(proc)
        return 1
    except KeyboardInterrupt:
        print("stopping Airflow...", flush=True)
        if proc is not None:
            stop(proc)
        print("stopped", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
