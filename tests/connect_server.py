"""A real Spark Connect server, started from pyspark's own sbin/start-connect-server.sh in the foreground."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyspark
from jvm import daemon_env
from spark_cluster import LOOPBACK, free_port, signal_group

if TYPE_CHECKING:
    from hosts import LoopbackHost


class ConnectServer:
    """A Connect server on ``master`` (its driver is the server's JVM), listening on a free loopback port.

    ``conf``: the server application's Spark settings (``--conf``). Its logs and pid file stay in ``workdir``.
    ``host``: the address its gRPC port listens on; ``inside``: the namespace host it runs in (then only
    commands run there reach it). ``cores``: the server (and its executors' Python workers) runs on that many of
    this machine's CPUs: the cores ``local[*]`` counts, whatever the machine. ``token``: the token its clients
    must give, in the server's environment (a ``--conf`` would be in its log's command line); pyspark sends one
    without TLS to ``localhost`` alone (:attr:`token_url`).
    """

    def __init__(
        self,
        workdir: Path,
        master: str = "local[2]",
        *,
        host: str = LOOPBACK,
        inside: LoopbackHost | None = None,
        cores: int | None = None,
        token: str | None = None,
        **conf: str,
    ) -> None:
        self.workdir = workdir
        self.spark_home = Path(pyspark.__file__).parent
        self.port = free_port()
        self.host = host
        self.inside = inside
        self.url = f"sc://{f'[{host}]' if ':' in host else host}:{self.port}"
        self.master = master
        self.conf = {"spark.ui.enabled": "false", "spark.connect.grpc.binding.address": host, **conf}
        self.token = token
        self._proc: subprocess.Popen[bytes] | None = None
        self.cpus = sorted(os.sched_getaffinity(0))[:cores] if cores else None
        if self.cpus is not None and len(self.cpus) < (cores or 0):
            raise RuntimeError(f"the server asks for {cores} cores, and this process may run on {len(self.cpus)}")

    @property
    def token_url(self) -> str:
        """The URL with the token: to ``localhost``, where pyspark sends a token without TLS."""
        return f"sc://localhost:{self.port}/;token={self.token}"

    @property
    def log_file(self) -> Path:
        return self.workdir / "connect-server.log"

    def _answers(self) -> bool:
        if self.inside is not None:  # asked from inside its host
            probe = f"import socket; socket.create_connection(({self.host!r}, {self.port}), timeout=1)"
            return subprocess.run(self.inside.command(sys.executable, "-c", probe), capture_output=True).returncode == 0
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def start(self, timeout: float = 300.0) -> ConnectServer:
        args = ["--master", self.master, "--conf", f"spark.connect.grpc.binding.port={self.port}"]
        for key, value in self.conf.items():
            args += ["--conf", f"{key}={value}"]
        env = {
            **os.environ,
            **daemon_env(),
            "SPARK_HOME": str(self.spark_home),
            "SPARK_NO_DAEMONIZE": "1",
            "SPARK_LOG_DIR": str(self.workdir),
            "SPARK_PID_DIR": str(self.workdir),
            "SPARK_LOCAL_IP": LOOPBACK,
            "PYSPARK_PYTHON": sys.executable,  # the server's executors run this interpreter
        }
        if self.token is not None:
            env["SPARK_CONNECT_AUTHENTICATE_TOKEN"] = self.token
        log = open(self.log_file, "wb")  # noqa: SIM115 - the server's output for its lifetime
        command = [str(self.spark_home / "sbin" / "start-connect-server.sh"), *args]
        self._proc = subprocess.Popen(
            command if self.inside is None else self.inside.command(*command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if self.cpus is None else lambda: os.sched_setaffinity(0, self.cpus),
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the Spark Connect server did not come up; see {self.log_file}")
            time.sleep(0.5)
        return self

    def warm(self, tries: int = 2, wait: float = 90.0) -> ConnectServer:
        """Run one small Python job on the server, in a session of its own, before the tests' runs.

        The first Python job of a fresh server whose application encrypts (``spark.network.crypto.enabled``) was
        seen three times here, each under load, to stall in the executor before its Python worker started (no
        "Starting Python task execution" in the server's log after its first encrypted connection to the
        driver), until the run's start timeout; later jobs never did. A stalled warm-up is interrupted and tried
        again, so that the tests time the runs, not that start (docs/troubleshooting.md).
        """
        for _ in range(tries):
            with connect_session(self.url) as spark:
                done = threading.Event()

                def job(spark: Any = spark, done: threading.Event = done) -> None:
                    try:
                        spark.range(2, numPartitions=2).mapInArrow(lambda batches: batches, "id long").collect()
                    except Exception:  # noqa: BLE001 - interrupted below, or failed: tried again
                        return
                    done.set()

                thread = threading.Thread(target=job, daemon=True)
                thread.start()
                if not done.wait(wait):
                    spark.interruptAll()
                thread.join(30)
                if done.is_set():
                    return self
        raise RuntimeError(f"the Spark Connect server ran no Python job in {tries} tries; see {self.log_file}")

    def stop(self) -> None:
        """End the server's process group (the scripts and the JVM) and wait for the JVM to exit."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        deadline = time.monotonic() + 30
        while signal_group(self._proc.pid, 0) and time.monotonic() < deadline:  # the JVM may outlive its script
            time.sleep(0.2)
        self._proc = None


@contextlib.contextmanager
def connect_session(url: str) -> Iterator[Any]:
    """A Spark Connect session to ``url``, stopped afterwards.

    Made with the Connect module's own builder: ``pyspark.sql.SparkSession.builder.remote(url)`` would also set
    ``SPARK_CONNECT_MODE_ENABLED`` in this process's environment, and every classic session made after it in
    the test process would be a Connect one.
    """
    from pyspark.sql.connect.session import SparkSession

    spark = SparkSession.builder.remote(url).getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()
