"""Big arguments: launch seconds and bytes the driver sends, HorovodRunner side by side with horovod.spark.run.

A trivial Horovod job (``hvd.init()``, every rank allgathers the length and the ends of its ``blob`` argument,
which the driver checks) runs with a ``blob`` of 0, 20 and 200 MB of random bytes (incompressible):

``local[2]``
    ``np=2`` on a ``local[2]`` SparkSession;
``standalone``
    ``np=4`` on a Spark standalone cluster on loopback, 2 workers × 2 cores (started here, from pyspark's own
    ``bin/spark-class``), one executor per worker.

each way: ``HorovodRunner(np).run(job, blob=blob)`` and ``horovod.spark.run(job, kwargs={"blob": blob},
num_proc=np, use_gloo=True)``, one untimed warm-up each, then ``--repeats`` rounds interleaved.

Per run (medians printed): wall seconds; bytes the driver sent to other processes over TCP, as a multiple of
the pickled argument: its Python process's sends are counted as they happen (``socket.socket.send*`` wrapped
in this process), its JVM's from the kernel's per-connection counters (``ss -ti``, polled every 0.2 s),
leaving out the connections between the driver's Python process and its JVM; the driver's Python process's
peak RSS growth over its size before the run (sampled every 5 ms), and its JVM's.
Goal: HorovodRunner's driver bytes ≈ 1× the payload whatever np.

Run it from the repository root::

    make bench                                   # runs .venv/bin/python benchmarks/payload.py among others
    .venv/bin/python benchmarks/payload.py --repeats 3 --sizes 0 20 200 --json /tmp/payload.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import logging  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from peaks import Peaks  # noqa: E402
from rounds import benchmark_parser, markdown_table, median, quiet_logging, shown, write_json  # noqa: E402
from spark_cluster import StandaloneCluster  # noqa: E402

MB = 1_000_000
DIGITS = 2  # the medians' decimals


def job(blob: bytes) -> list[tuple[int, str]]:
    """Every rank reports the length and the ends of the ``blob`` it received."""
    import horovod.torch as hvd

    hvd.init()
    return hvd.allgather_object((len(blob), blob[:8].hex() + blob[-8:].hex()))


# --- what the driver sends ---------------------------------------------------------------------------

Address = tuple[str, int]
_SS_SOCKET = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+),")
_SS_SENT = re.compile(r"bytes_sent:(\d+)")


def _address(host: str, port: str) -> Address:
    return host.strip("[]").removeprefix("::ffff:"), int(port)


class DriverTraffic:
    """Bytes the driver (this Python process and its JVM) sends over TCP to other processes."""

    def __init__(self, jvm_pid: int) -> None:
        self.pids = {os.getpid(), jvm_pid}
        self._jvm = jvm_pid
        self._lock = threading.Lock()
        self._python: dict[tuple[Address, Address], int] = {}  # (local, peer) -> bytes sent, cumulative
        self._jvm_sent: dict[tuple[Address, Address], int] = {}  # from ss, latest seen
        self._owner: dict[Address, int] = {}  # who holds each local address seen
        self._stop = threading.Event()
        self._wrap_socket_sends()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _count(self, sock: socket.socket, sent: int) -> None:
        try:
            key = (sock.getsockname()[:2], sock.getpeername()[:2])
        except OSError:
            return
        with self._lock:
            self._python[key] = self._python.get(key, 0) + sent

    def _wrap_socket_sends(self) -> None:
        cls, meter = socket.socket, self
        send, sendall = cls.send, cls.sendall

        def counted_send(sock: socket.socket, data: Any, *args: Any) -> int:
            sent = send(sock, data, *args)
            meter._count(sock, sent)
            return sent

        def counted_sendall(sock: socket.socket, data: Any, *args: Any) -> None:
            sendall(sock, data, *args)
            meter._count(sock, memoryview(data).nbytes)

        cls.send, cls.sendall = counted_send, counted_sendall  # type: ignore[method-assign]

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.poll()

    def poll(self) -> None:
        out = subprocess.run(["ss", "-tinpHO"], capture_output=True, text=True).stdout
        with self._lock:
            for line in out.splitlines():
                found = _SS_SOCKET.search(line)
                if not found:
                    continue
                local, peer, pid = _address(found[1], found[2]), _address(found[3], found[4]), int(found[5])
                self._owner[local] = pid
                if pid == self._jvm:
                    sent = _SS_SENT.search(line)
                    key = (local, peer)
                    self._jvm_sent[key] = max(self._jvm_sent.get(key, 0), int(sent[1]) if sent else 0)

    def snapshot(self) -> dict[tuple[Address, Address], int]:
        self.poll()
        with self._lock:
            python = {("py", *key): sent for key, sent in self._python.items()}
            return {**python, **{("jvm", *key): sent for key, sent in self._jvm_sent.items()}}

    def sent_since(self, before: dict[tuple[Address, Address], int]) -> int:
        """Bytes sent since ``before`` (a :meth:`snapshot`) to processes other than the driver's own two."""
        after = self.snapshot()
        with self._lock:
            return sum(
                sent - before.get(key, 0) for key, sent in after.items() if self._owner.get(key[2]) not in self.pids
            )

    def close(self) -> None:
        self._stop.set()
        self._poller.join()


# --- the launchers -----------------------------------------------------------------------------------


def hr_launch(np: int) -> Callable[[bytes], list[tuple[int, str]]]:
    from airflow_provider_hvd import HorovodRunner

    return lambda blob: HorovodRunner(np=np).run(job, blob=blob)


def hvd_spark_launch(np: int) -> Callable[[bytes], list[tuple[int, str]]]:
    import horovod.spark

    return lambda blob: horovod.spark.run(job, kwargs={"blob": blob}, num_proc=np, use_gloo=True, verbose=0)[0]


def run_once(
    launch: Callable[[bytes], Any], blob: bytes, np: int, traffic: DriverTraffic, jvm_pid: int, payload_bytes: int
) -> dict[str, Any]:
    expected = [(len(blob), blob[:8].hex() + blob[-8:].hex())] * np
    before = traffic.snapshot()
    python, jvm = psutil.Process(), psutil.Process(jvm_pid)
    with Peaks(0.005, python=lambda: python.memory_info().rss, jvm=lambda: jvm.memory_info().rss) as memory:
        started = time.perf_counter()
        result = launch(blob)
        seconds = time.perf_counter() - started
    if result != expected:
        raise RuntimeError(f"the ranks did not all get the argument intact: {result!r}")
    sent = traffic.sent_since(before)
    return {
        "seconds": seconds,
        "sent_mb": sent / MB,
        "sent_x": sent / payload_bytes if payload_bytes > MB else None,
        "python_rss_mb": memory.growth("python") / MB,
        "jvm_rss_mb": memory.growth("jvm") / MB,
    }


def measure_cluster(
    name: str, master: str, np: int, conf: dict[str, str], sizes_mb: list[int], repeats: int, warm_up: bool = True
) -> list[dict[str, Any]]:
    import cloudpickle
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(f"payload-bench-{name}")
    for key, value in {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", **conf}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())  # type: ignore[union-attr]
    traffic = DriverTraffic(jvm_pid)
    methods = {"HorovodRunner": hr_launch(np), "horovod.spark.run": hvd_spark_launch(np)}
    rows = []
    try:
        for size_mb in sizes_mb:
            blob = os.urandom(size_mb * MB) if size_mb else b""
            payload_bytes = len(cloudpickle.dumps(blob))
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for launch in methods.values() if warm_up else ():
                run_once(launch, blob, np, traffic, jvm_pid, payload_bytes)
            for round_no in range(repeats):
                for method, launch in methods.items():
                    runs[method].append(run_once(launch, blob, np, traffic, jvm_pid, payload_bytes))
                print(f"{name} {size_mb} MB: round {round_no + 1}/{repeats}", file=sys.stderr, flush=True)
            for method, results in runs.items():
                rows.append(
                    {
                        "cluster": name,
                        "np": np,
                        "size_mb": size_mb,
                        "method": method,
                        **{key: median([r[key] for r in results], DIGITS) for key in results[0]},
                        "runs": results,
                    }
                )
            del blob
    finally:
        traffic.close()
        spark.stop()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "run",
        "argument",
        "method",
        "launch s",
        "driver sent MB",
        "× payload",
        "driver Python RSS +MB",
        "driver JVM RSS +MB",
    )
    cells = (
        (
            f"np={r['np']} {r['cluster']}",
            f"{r['size_mb']} MB",
            r["method"],
            f"{r['seconds']:.2f}",
            f"{r['sent_mb']:.1f}",
            shown(r["sent_x"], unit="×"),
            f"{r['python_rss_mb']:.0f}",
            f"{r['jvm_rss_mb']:.0f}",
        )
        for r in rows
    )
    return markdown_table(head, cells)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, repeats=3, what="rounds per size, after a warm-up", check=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 20, 200], help="argument sizes in MB")
    parser.add_argument("--clusters", nargs="+", default=["local", "standalone"], choices=["local", "standalone"])
    args = parser.parse_args(argv)
    repeats = 1 if args.check else args.repeats
    quiet_logging(logging.ERROR)  # the size warnings are expected here
    rows = []
    if "local" in args.clusters:
        rows += measure_cluster("local[2]", "local[2]", 2, {}, args.sizes, repeats, not args.check)
    if "standalone" in args.clusters:
        with tempfile.TemporaryDirectory(prefix="payload-bench-cluster-") as workdir:
            cluster = StandaloneCluster(Path(workdir), workers=2, cores=2).start()
            try:
                conf = {"spark.executor.cores": "2", "spark.cores.max": "4"}
                rows += measure_cluster("standalone", cluster.url, 4, conf, args.sizes, repeats, not args.check)
            finally:
                cluster.stop()
    print(f"big arguments ({repeats} rounds {'with no' if args.check else 'after a'} warm-up; medians)")
    print(format_table(rows))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
