"""Launch overhead of HorovodRunner, side by side with Horovod's own launchers and a bare floor.

Measures the wall time of launching a trivial 2-rank Horovod job (``hvd.init()``, one tiny
allreduce, return the rank) four ways, on one warm ``local[2]`` SparkSession:

``hr_spark``
    ``HorovodRunner(np=2).run(trivial)``: this project's Spark barrier launch.
``hvd_spark``
    ``horovod.spark.run(trivial, num_proc=2, use_gloo=True)``: Horovod's own Spark launcher.
``floor``
    Two plain ``python -c`` processes that import torch and horovod and join through Horovod's
    rendezvous HTTP server (started once, outside the timing): the cost any launcher pays.
``hr_local``
    ``HorovodRunner(np=-2).run(trivial)``: local mode, no Spark.

Each method gets one untimed warm-up, then ``--repeats`` timed runs interleaved round-robin
(A, B, C, D, A, B, C, D, ...) so machine noise hits all methods alike. Printed per method: median
and min wall seconds; plus the ratios of ``hr_spark`` to ``hvd_spark`` and to ``floor``.

Run it from the repository root::

    make bench                                   # runs .venv/bin/python benchmarks/launch.py
    .venv/bin/python benchmarks/launch.py --repeats 3 --json /tmp/launch.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from pyspark.sql import SparkSession  # noqa: E402
from rounds import Method, run_rounds  # noqa: E402

NUM_PROC = 2
HOST = "127.0.0.1"

# What a floor rank runs: the same work as `trivial`, with no launcher around it.
FLOOR_RANK_CODE = (
    "import torch, horovod.torch as hvd\nhvd.init()\nhvd.allreduce(torch.ones(1), name='bench')\nhvd.shutdown()\n"
)


def trivial() -> int:
    """The job every launcher runs: join the ring, one tiny allreduce, return the rank."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1), name="bench")
    return hvd.rank()


# --- the launchers -------------------------------------------------------------------------------


def hr_run(np: int) -> Callable[[], object]:
    from airflow_provider_hvd import HorovodRunner

    return lambda: HorovodRunner(np=np).run(trivial)


def hvd_spark_run() -> Callable[[], object]:
    """`horovod.spark.run`, or a launcher that raises why it cannot be used."""
    try:
        import horovod.spark
    except ImportError as exc:  # e.g. a missing optional dependency of horovod.spark
        reason = f"horovod.spark cannot be imported: {exc}"

        def unavailable() -> object:
            raise RuntimeError(reason)

        return unavailable

    def launch() -> object:
        results = horovod.spark.run(trivial, num_proc=NUM_PROC, use_gloo=True, verbose=0)
        if sorted(results) != list(range(NUM_PROC)):
            raise RuntimeError(f"unexpected results {results!r}")
        return results

    return launch


class FloorLauncher:
    """Two bare processes joined by Horovod's rendezvous server, which is started once and reused."""

    def __init__(self) -> None:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        self._server = RendezvousHTTPServer((HOST, 0), RendezvousHandler, 0)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _rank_env(self, slot: Any) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HOROVOD_RANK=str(slot.rank),
            HOROVOD_SIZE=str(slot.size),
            HOROVOD_LOCAL_RANK=str(slot.local_rank),
            HOROVOD_LOCAL_SIZE=str(slot.local_size),
            HOROVOD_CROSS_RANK=str(slot.cross_rank),
            HOROVOD_CROSS_SIZE=str(slot.cross_size),
            HOROVOD_HOSTNAME=HOST,
            HOROVOD_GLOO_RENDEZVOUS_ADDR=HOST,
            HOROVOD_GLOO_RENDEZVOUS_PORT=str(self.port),
            HOROVOD_CONTROLLER="gloo",
            HOROVOD_CPU_OPERATIONS="gloo",
            HOROVOD_GLOO_IFACE="lo",
        )
        return env

    def __call__(self) -> None:
        from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

        slots = get_host_assignments([HostInfo(HOST, NUM_PROC)], NUM_PROC)
        self._server.init(slots)  # fresh scopes and key-value store for this run
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", FLOOR_RANK_CODE],
                env=self._rank_env(slot),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for slot in slots
        ]
        failures = []
        for slot, proc in zip(slots, procs, strict=False):
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
                failures.append(f"rank {slot.rank} exited {proc.returncode}: {tail[0]}")
        if failures:
            raise RuntimeError("; ".join(failures))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- running and reporting -----------------------------------------------------------------------


def quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("airflow_provider_hvd").setLevel(logging.WARNING)


def start_spark() -> SparkSession:
    spark = (
        SparkSession.builder.master(f"local[{NUM_PROC}]").config("spark.ui.showConsoleProgress", "false").getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def summarize(methods: list[Method]) -> dict[str, Any]:
    """Median and min per method, and the ratios of hr_spark's median to hvd_spark's and floor's."""
    figures: dict[str, Any] = {"methods": {}, "ratios": {}}
    for m in methods:
        figures["methods"][m.name] = {
            "label": m.label,
            "times_s": [round(t, 4) for t in m.times],
            "median_s": round(statistics.median(m.times), 4) if m.times and m.error is None else None,
            "min_s": round(min(m.times), 4) if m.times and m.error is None else None,
            "error": m.error,
        }
    by_name = figures["methods"]
    for other in ("hvd_spark", "floor"):
        num, den = by_name["hr_spark"]["median_s"], by_name[other]["median_s"]
        figures["ratios"][f"hr_spark/{other}"] = round(num / den, 2) if num and den else None
    return figures


def format_table(figures: dict[str, Any], repeats: int) -> str:
    rows = [("method", "median s", "min s")]
    for info in figures["methods"].values():
        if info["error"]:
            rows.append((info["label"], "n/a", info["error"]))
        else:
            rows.append((info["label"], f"{info['median_s']:.2f}", f"{info['min_s']:.2f}"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"launch overhead, {NUM_PROC} ranks, {repeats} repeats (after 1 warm-up each)"]
    for label, med, low in rows:
        lines.append(f"{label:<{width[0]}}  {med:>{width[1]}}  {low}")
    for name, ratio in figures["ratios"].items():
        lines.append(f"{name} (median): {'n/a' if ratio is None else f'{ratio:.2f}x'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    spark = start_spark()
    floor = FloorLauncher()
    methods = [
        Method("hr_spark", f"HorovodRunner(np={NUM_PROC})", hr_run(NUM_PROC)),
        Method("hvd_spark", "horovod.spark.run", hvd_spark_run()),
        Method("floor", "floor (2 bare procs)", floor),
        Method("hr_local", f"HorovodRunner(np=-{NUM_PROC})", hr_run(-NUM_PROC)),
    ]
    try:
        run_rounds(methods, args.repeats)
    finally:
        floor.close()
        spark.stop()
    figures = summarize(methods)
    figures["repeats"] = args.repeats
    print(format_table(figures, args.repeats))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
