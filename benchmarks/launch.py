"""Launch overhead of HorovodRunner, side by side with Horovod's own launchers and a bare floor.

Measures the wall time of launching a trivial 2-rank Horovod job (``hvd.init()``, one tiny
allreduce, return the rank) four ways, on one warm ``local[2]`` SparkSession:

``hr_spark``
    ``HorovodRunner(np=2).run(rounds.trivial)``: this project's Spark barrier launch.
``hvd_spark``
    ``horovod.spark.run(rounds.trivial, num_proc=2, use_gloo=True)``: Horovod's own Spark launcher.
``floor``
    Two plain ``python -c`` processes that import torch and horovod and join through Horovod's
    rendezvous HTTP server (started once, outside the timing): the cost any launcher pays.
``hr_local``
    ``HorovodRunner(np=-2).run(rounds.trivial)``: local mode, no Spark.

Each method gets one untimed warm-up, then ``--repeats`` timed runs interleaved round-robin
(A, B, C, D, A, B, C, D, ...) so machine noise hits all methods alike. Printed per method: median
and min wall seconds; plus the ratios of ``hr_spark`` to ``hvd_spark`` and to ``floor``. A method that
did not run is n/a, and the exit status is 1 (``--check``: one run of each, no warm-up, to see that).

Run it from the repository root::

    make bench                                   # runs .venv/bin/python benchmarks/launch.py
    .venv/bin/python benchmarks/launch.py --repeats 3 --json /tmp/launch.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import subprocess  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import rounds  # noqa: E402

NUM_PROC = 2
HOST = "127.0.0.1"
RATIOS = (("hr_spark", "hvd_spark"), ("hr_spark", "floor"))  # medians compared
DIGITS = 4  # the seconds' decimals in the JSON

# What a floor rank runs: the same work as `rounds.trivial`, with no launcher around it.
FLOOR_RANK_CODE = (
    "import torch, horovod.torch as hvd\nhvd.init()\nhvd.allreduce(torch.ones(1), name='bench')\nhvd.shutdown()\n"
)


# --- the launchers -------------------------------------------------------------------------------


def hr_run(np: int) -> Callable[[], object]:
    from airflow_provider_hvd import HorovodRunner

    return lambda: HorovodRunner(np=np).run(rounds.trivial)


def hvd_spark_run() -> Callable[[], object]:
    """`horovod.spark.run`, or a launcher that raises why it cannot be used."""
    try:
        import horovod.spark
    except ImportError as exc:  # e.g. a missing optional dependency of horovod.spark
        reason = f"horovod.spark cannot be imported: {exc}"

        def unavailable() -> object:
            raise RuntimeError(reason)

        return unavailable

    import cloudpickle

    # Horovod pickles a function by reference: its ranks would import `rounds`, which is not on their path
    cloudpickle.register_pickle_by_value(rounds)

    def launch() -> object:
        results = horovod.spark.run(rounds.trivial, num_proc=NUM_PROC, use_gloo=True, verbose=0)
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


def format_table(figures: dict[str, Any], repeats: int) -> str:
    rows = [("method", "median s", "min s")]
    for info in figures["methods"].values():
        if info["error"]:
            rows.append((info["label"], "n/a", info["error"]))
        else:
            rows.append((info["label"], f"{info['median_s']:.2f}", f"{info['min_s']:.2f}"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    warmed = "after 1 warm-up each" if figures.get("warm_up", True) else "no warm-up"
    lines = [f"launch overhead, {NUM_PROC} ranks, {repeats} repeats ({warmed})"]
    for label, med, low in rows:
        lines.append(f"{label:<{width[0]}}  {med:>{width[1]}}  {low}")
    for name, ratio in figures["ratios"].items():
        lines.append(f"{name} (median): {rounds.shown(ratio, unit='x')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = rounds.benchmark_parser(__doc__, repeats=5, what="timed runs per method", check=True).parse_args(argv)
    repeats = 1 if args.check else args.repeats
    rounds.quiet_logging()
    spark = rounds.local_spark(NUM_PROC)
    floor = FloorLauncher()
    methods = [
        rounds.Method("hr_spark", f"HorovodRunner(np={NUM_PROC})", hr_run(NUM_PROC)),
        rounds.Method("hvd_spark", "horovod.spark.run", hvd_spark_run()),
        rounds.Method("floor", "floor (2 bare procs)", floor),
        rounds.Method("hr_local", f"HorovodRunner(np=-{NUM_PROC})", hr_run(-NUM_PROC)),
    ]
    try:
        rounds.run_rounds(methods, repeats, warm_up=not args.check)
    finally:
        floor.close()
        spark.stop()
    figures = rounds.launch_figures(methods, RATIOS, DIGITS)
    figures["repeats"] = repeats
    figures["warm_up"] = not args.check
    print(format_table(figures, repeats))
    rounds.write_json(args.json, figures)
    return rounds.exit_status(rounds.not_run(methods))


if __name__ == "__main__":
    sys.exit(main())
