"""A real MLflow tracking server on loopback, from the full MLflow in .venv-mlflow (SQLite store, local artifacts),
with MLflow's basic-auth app on where asked."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from spark_cluster import LOOPBACK, free_port, signal_group

MLFLOW = Path(__file__).resolve().parent.parent / ".venv-mlflow" / "bin" / "mlflow"


class MlflowServer:
    """``mlflow server`` with its store and artifacts under ``workdir``; :meth:`start` waits for its /health.

    ``auth``: MLflow's basic-auth app (``--app-name basic-auth``): every request needs ``username`` and
    ``password`` (its admin's), and one without them gets 401.
    """

    def __init__(self, workdir: Path, *, auth: bool = False) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.auth = auth
        self.username = "admin"
        self.password = f"hvd-{secrets.token_hex(8)}"  # (at least 12 characters: MLflow's rule)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300) -> MlflowServer:
        if not MLFLOW.exists():
            raise RuntimeError(f"{MLFLOW} is missing: `make setup` installs the tracking server's venv (.venv-mlflow)")
        command = [
            str(MLFLOW), "server", "--host", LOOPBACK, "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.workdir}/mlflow.db",
            "--default-artifact-root", str(self.workdir / "artifacts"),
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
        # no job runner: MLflow 3.17 starts eight huey consumer processes for server-side jobs (a whole core at
        # start-up on this machine), which no test uses
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        if self.auth:
            command[2:2] = ["--app-name", "basic-auth"]
            env.update(self._auth_settings())
        with open(self.workdir / "server.log", "wb") as log:
            # a session of its own: its workers are stopped with it (stop)
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self._proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)  # nothing to wait on but its answer
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {timeout:g}s:\n{self.log_tail()}")

    def _auth_settings(self) -> dict[str, str]:
        """The basic-auth app's settings: its users' database in ``workdir``, its admin, nobody else."""
        config = self.workdir / "basic_auth.ini"
        config.write_text(
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = sqlite:///{self.workdir}/basic_auth.db\n"
            f"admin_username = {self.username}\n"
            f"admin_password = {self.password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "auth_cache_ttl_seconds = 600\n"  # (else each request hashes the password anew: slow on a busy box)
        )
        return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after 20 s; returns once the server and
        its workers have exited."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        deadline = time.monotonic() + 20
        while signal_group(proc.pid, 0):  # its workers (not our children: no wait() to block on)
            if time.monotonic() > deadline:
                signal_group(proc.pid, signal.SIGKILL)
            time.sleep(0.1)
