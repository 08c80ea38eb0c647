"""A real Airflow deployment for the tests: `airflow standalone` (scheduler with LocalExecutor, API server, dag
processor, triggerer) in its own AIRFLOW_HOME, on a database of its own on the tests' PostgreSQL server
(tests/postgres.py: as production, not SQLite, which several components writing at once found locked under
load), on a free loopback port, driven through the REST API."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psutil
from jobs import alive
from spark_cluster import LOOPBACK, free_port

FINISHED = {"success", "failed"}
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown a failure's report


class AirflowDeployment:
    """``airflow standalone`` under ``home`` on the metadata database ``database`` (a SQLAlchemy URL, e.g.
    :meth:`postgres.PostgresServer.create_database`'s); every process it starts is ended by :meth:`stop`."""

    def __init__(self, home: Path, dags_folder: str, database: str, env: dict[str, str]) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = home / "standalone.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW_", "AIRFLOW__"))},
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # it starts `airflow ...`
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": dags_folder,
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            # the DAG files do not change while it runs: parsed once, not every 30 s (each parse imports them all)
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",  # the REST API without a login
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database,
            "AIRFLOW__API__HOST": LOOPBACK,
            "AIRFLOW__API__PORT": str(self.port),
            **env,
        }
        # on a loaded 2-core machine the API server may take a while to answer
        self.api = httpx.Client(base_url=f"{self.url}/api/v2", timeout=300)
        self._proc: subprocess.Popen | None = None

    def start(self, dag_ids: list[str], timeout: float = 180.0) -> AirflowDeployment:
        """Start, then wait until every component is healthy and ``dag_ids`` are parsed."""
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.home,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._ready(dag_ids):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"airflow standalone did not come up:\n{self.log_tail()}")
            time.sleep(1)
        return self

    def _ready(self, dag_ids: list[str]) -> bool:
        try:
            health = self.api.get("/monitor/health").json()
            parsed = {dag["dag_id"] for dag in self.api.get("/dags", params={"limit": 100}).json()["dags"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        healthy = all(health.get(part, {}).get("status") == "healthy" for part in ("scheduler", "dag_processor"))
        return healthy and set(dag_ids) <= parsed

    def stop(self, grace: float = 20.0) -> None:
        """End the standalone process group, and any process of it that left the group."""
        self.api.close()
        if self._proc is None:
            return
        try:
            family = [self._proc.pid, *(p.pid for p in psutil.Process(self._proc.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            family = []
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)  # each component shuts down on SIGTERM
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(pid) for pid in family):
            time.sleep(0.2)
        for pid in family:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._proc.wait(10)
        self._proc = None

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- the REST API ---

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.api.request(method, path, **kwargs)
        assert resp.status_code < 300, f"{method} {path}: {resp.status_code} {resp.text}"
        return resp.json()

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self._json("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def _ti_path(self, dag_id: str, run_id: str, task_id: str = "") -> str:
        path = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"
        return f"{path}/taskInstances/{task_id}" if task_id else path

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self._json("GET", self._ti_path(dag_id, run_id))["state"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.run_state(dag_id, run_id)) not in FINISHED:
            assert time.monotonic() < deadline, f"{dag_id} run {run_id} still {state} after {timeout:.0f}s"
            time.sleep(1)
        return state

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return self._json("GET", self._ti_path(dag_id, run_id, task_id))

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> list[dict[str, Any]]:
        """The task log's records, as the UI reads them (``event``, ``level``, ``logger``...)."""
        path = f"{self._ti_path(dag_id, run_id, task_id)}/logs/{try_number}"
        return self._json("GET", path, headers={"Accept": "application/json"})["content"]

    def state_store(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        """The task instance's task state store, key → value."""
        entries = self._json("GET", f"{self._ti_path(dag_id, run_id, task_id)}/state-store")["task_state_store"]
        return {entry["key"]: entry["value"] for entry in entries}

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        return self._json("GET", f"{self._ti_path(dag_id, run_id, task_id)}/xcomEntries/{key}")["value"]

    def extra_links(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str | None]:
        return self._json("GET", f"{self._ti_path(dag_id, run_id, task_id)}/links")["extra_links"]

    def mark_failed(self, dag_id: str, run_id: str, task_id: str) -> None:
        self._json("PATCH", self._ti_path(dag_id, run_id, task_id), json={"new_state": "failed"})


def event_lines(records: list[dict[str, Any]]) -> list[str]:
    """Each line of the task log's events (the ranks' lines come a batch to an event, one a line)."""
    return [line for record in records for line in str(record.get("event", "")).split("\n")]


def log_text(records: list[dict[str, Any]]) -> str:
    """A task log as the UI shows it: ``level logger: event``, and the exception of an error record."""
    lines = []
    for record in records:
        lines.append(f"{record.get('level', '-')} {record.get('logger', '-')}: {record.get('event', '')}")
        lines.extend(f"    {exc.get('exc_type')}: {exc.get('exc_value')}" for exc in record.get("error_detail") or [])
    return "\n".join(lines)


def show_log_if_failed(request: Any, deployment: AirflowDeployment, failed_before: int) -> None:
    """At a module fixture's end: the last lines of airflow standalone's log, if a test of the module failed."""
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(f"\n--- airflow standalone's log ({deployment.log_path}), last lines ---")
        reporter.write_line(deployment.log_tail(200))
