"""A real Spark standalone cluster on loopback: a master and workers started from pyspark's bin/spark-class."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pyspark
from jvm import daemon_env

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a server's process group: whether it still had a member to signal (0 only asks)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


class StandaloneCluster:
    """``workers`` workers of ``cores`` cores; with ``gpus`` > 0, each has that many made-up GPUs, numbered on
    from the previous worker's (worker 0: "0", "1"; worker 1: "2", "3"), which Spark schedules as real ones."""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, gpus: int = 0) -> None:
        self.workdir = workdir
        self.spark_home = Path(pyspark.__file__).parent
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://{LOOPBACK}:{self.port}"
        self.web_ui = f"http://{LOOPBACK}:{self.ui_port}"
        # what an application needs to know this master's web UI (not on the default port 8080)
        self.app_conf = {"spark.horovodRunner.masterWebUiUrl": self.web_ui}
        self._procs: list[subprocess.Popen] = []
        self._workers, self._cores, self._gpus = workers, cores, gpus

    def _gpu_properties(self, worker: int) -> list[str]:
        if not self._gpus:
            return []
        addresses = [str(worker * self._gpus + i) for i in range(self._gpus)]
        script = self.workdir / f"gpus-{worker}.sh"
        script.write_text(f"#!/bin/sh\necho '{json.dumps({'name': 'gpu', 'addresses': addresses})}'\n")
        script.chmod(0o755)
        properties = self.workdir / f"worker-{worker}.properties"
        properties.write_text(
            f"spark.worker.resource.gpu.amount {self._gpus}\nspark.worker.resource.gpu.discoveryScript {script}\n"
        )
        return ["--properties-file", str(properties)]

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        env = {**os.environ, **daemon_env(), "SPARK_HOME": str(self.spark_home), "SPARK_LOCAL_IP": LOOPBACK}
        self._procs.append(
            subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.web_ui}/json/", timeout=2) as resp:
                return int(json.load(resp).get("aliveworkers", 0))
        except (OSError, ValueError):  # not up yet (its UI answers HTML while the master starts)
            return 0

    def start(self, timeout: float = 120.0) -> StandaloneCluster:
        self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        )
        for i in range(self._workers):
            work = self.workdir / f"worker-{i}"
            work.mkdir(parents=True, exist_ok=True)
            self._spawn(
                f"worker-{i}",
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host",
                LOOPBACK,
                "--cores",
                str(self._cores),
                "--memory",
                "2g",
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(work),
                *self._gpu_properties(i),
            )
        deadline = time.monotonic() + timeout
        while self.alive_workers() < self._workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                self.stop()
                raise RuntimeError(f"the standalone cluster did not come up; see the logs in {self.workdir}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        for proc in reversed(self._procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
