"""A local Spark Connect server to try submitted runs on: ``python -m airflow_provider_hvd.connect_server``.

::

    python -m airflow_provider_hvd.connect_server start            # np=2 runs: local[3]; Ctrl-C stops it
    python -m airflow_provider_hvd.connect_server start --daemon   # in the background, until:
    python -m airflow_provider_hvd.connect_server stop

pyspark's own Connect server (its wheel carries it) on ``local[np + 1]``: a submitted run takes a task slot for
each of its ``np`` ranks and one for its host (docs/durable-runs.md). Its log, its pid file and Spark's working
files are in one folder (``--dir``; by default ``$XDG_STATE_HOME/airflow-provider-hvd/connect-server``, that is
``~/.local/state/...``), not in pyspark's installation; its executors run this interpreter. ``stop`` ends the
server and every process it started, and removes the pid file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from .interrupts import Interrupts

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_PORT = 15002  # Spark Connect's own default: sc://localhost needs no port then
DEFAULT_NP = 2
STOP_GRACE_S = 30.0  # the JVM's shutdown (its SparkContext, its Python workers) before what is left is killed


def default_folder() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "airflow-provider-hvd" / "connect-server"


class LocalConnectServer:
    """pyspark's Connect server on ``local[slots]``, listening on ``host:port``; its files in ``folder``."""

    def __init__(self, folder: Path, slots: int, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.folder = folder
        self.slots = slots
        self.host = host
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None  # the server started here, until it is stopped

    @property
    def url(self) -> str:
        return f"sc://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.folder / "connect-server.log"

    @property
    def pid_file(self) -> Path:
        return self.folder / "connect-server.pid"

    def command(self, conf: dict[str, str]) -> list[str]:
        import pyspark

        settings = {
            "spark.connect.grpc.binding.address": self.host,
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.ui.showConsoleProgress": "false",  # its log is a file
            **conf,
        }
        spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
        args = [str(spark_submit), "--class", SERVER_CLASS, "--name", "Spark Connect server"]
        args += ["--master", f"local[{self.slots}]"]
        for key, value in settings.items():
            args += ["--conf", f"{key}={value}"]
        return args

    def environment(self) -> dict[str, str]:
        import pyspark

        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")}
        env["SPARK_HOME"] = str(Path(pyspark.__file__).parent)
        env["SPARK_CONNECT_MODE"] = "0"  # the server itself is classic Spark (as start-connect-server.sh sets)
        env.setdefault("PYSPARK_PYTHON", sys.executable)  # the ranks and the run's host need this package
        if self.host in ("127.0.0.1", "localhost"):
            env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        return env

    def running_pid(self) -> int | None:
        """The pid in the pid file if that process is this folder's server; a stale pid file is removed."""
        try:
            pid = int(self.pid_file.read_text().strip())
            if SERVER_CLASS in " ".join(psutil.Process(pid).cmdline()):
                return pid
        except (OSError, ValueError, psutil.Error):
            pass
        self.pid_file.unlink(missing_ok=True)
        return None

    def answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def start(
        self, conf: dict[str, str], timeout: float, interrupts: Interrupts | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the server in a session of its own and wait until it answers; SystemExit saying why if not.
        ``interrupts``: the command's Ctrl-C, held while the server forks (its pid is not known before)."""
        if (pid := self.running_pid()) is not None:
            raise SystemExit(
                f"a Connect server from {self.folder} is already running (pid {pid}): `{self.stop_command()}` first"
            )
        if self.answers():
            raise SystemExit(f"{self.host}:{self.port} is in use by another process: choose another with --port")
        self.folder.mkdir(parents=True, exist_ok=True)
        command, env = self.command(conf), self.environment()  # (before the hold: they import pyspark)
        deadline = time.monotonic() + timeout
        try:
            with interrupts.held() if interrupts else contextlib.nullcontext(), open(self.log_file, "ab") as log:
                proc = self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.folder,  # Spark's spark-warehouse and metastore_db go here, not where the user is
                    start_new_session=True,  # Ctrl-C in the terminal reaches this command, which stops it in order
                )
                self.pid_file.write_text(f"{proc.pid}\n")
            while not self.answers():
                if proc.poll() is not None or time.monotonic() > deadline:
                    what = "exited" if proc.poll() is not None else f"did not answer within {timeout:.0f}s"
                    raise SystemExit(f"the Spark Connect server {what}; its log:\n{self.log_tail()}")
                time.sleep(0.5)
        except BaseException:  # that SystemExit, or Ctrl-C while it starts
            if self.process is not None:
                self.stop(self.process.pid)
            raise
        return proc

    def stop(self, pid: int) -> None:
        """End the server's JVM and every process it started (the Python workers have process groups of their
        own), SIGKILL what is left after STOP_GRACE_S, and remove the pid file."""
        try:
            family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # the JVM's shutdown stops its SparkContext and Python workers
        _, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        self.pid_file.unlink(missing_ok=True)
        if self.process is not None and self.process.pid == pid:
            self.process.wait()
            self.process = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop_command(self) -> str:
        where = "" if self.folder == default_folder() else f" --dir {self.folder}"
        return f"{sys.executable} -m {__spec__.name}{where} stop"


def _conf(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description="A local Spark Connect server for trying submitted runs."
    )
    parser.add_argument(
        "--dir", type=Path, default=default_folder(), help="its log and pid file (default: %(default)s)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start it (in the foreground unless --daemon)")
    start.add_argument(
        "--np",
        type=_at_least_one,
        default=DEFAULT_NP,
        help="the most ranks a run will have: the server gets np + 1 task slots (its host takes one) (default: 2)",
    )
    start.add_argument("--port", type=int, default=DEFAULT_PORT, help="its gRPC port (default: %(default)s)")
    start.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: %(default)s)")
    start.add_argument("--conf", type=_conf, action="append", default=[], metavar="KEY=VALUE", help="a Spark setting")
    start.add_argument("--daemon", action="store_true", help="return once it answers; `stop` ends it")
    start.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it (default: %(default)s)")
    commands.add_parser("stop", help="stop the server started from --dir")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.dir.expanduser().resolve()
    if args.command == "stop":
        server = LocalConnectServer(folder, 0)
        if (pid := server.running_pid()) is None:
            print(f"no Connect server from {folder} is running")
            return 0
        server.stop(pid)
        print(f"stopped the Connect server (pid {pid})")
        return 0

    interrupts = Interrupts()  # Ctrl-C and SIGTERM stop it
    server = LocalConnectServer(folder, args.np + 1, args.host, args.port)
    how = f"stop it with: {server.stop_command()}" if args.daemon else "Ctrl-C stops it"
    try:  # a Ctrl-C stops the server, even one that comes while its address is printed
        proc = server.start(dict(args.conf), args.timeout, interrupts)
        print(
            f"Spark Connect server at {server.url} on local[{server.slots}] (runs of up to np={args.np}: each "
            "run's host takes a slot)\n"
            f"  connect: SparkSession.builder.remote({server.url!r}).getOrCreate()  "
            "(from pyspark.sql.connect.session)\n"
            f"  log: {server.log_file}  pid: {proc.pid}\n  {how}",
            flush=True,
        )
        if args.daemon:
            return 0
        code = proc.wait()
    except KeyboardInterrupt:
        if server.process is None:
            return 130  # (while it started: start() stopped it)
        server.stop(server.process.pid)
        print("stopped the Connect server", flush=True)
        return 0
    server.stop(proc.pid)  # what it started, if anything outlived it
    print(f"the Spark Connect server exited ({code}); its log:\n{server.log_tail()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
