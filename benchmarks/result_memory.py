"""The driver's memory for a large result: rank 0 returns ``--mib`` MiB (default 1,024), the driver gets it back.

``HorovodRunner(np=2)`` on a warm ``local[2]`` SparkSession (the agents run in Spark's Python workers, as on a
cluster). Measured: the driver Python process's peak RSS above its RSS before ``run`` (sampled every 10 ms),
as a multiple of the result's size (goal <= 1.2x: the result arrives in pieces that are let go as the object is
made from them, :class:`~airflow_provider_hvd.runner.shared.wire.Pieces`). Two results: one ``bytes`` object
(in-band in the pickle) and a NumPy array (pickle protocol 5's in-band buffer). Run::

    .venv/bin/python benchmarks/result_memory.py --mib 1024 [--json out.json]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import gc  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from airflow_provider_hvd import HorovodRunner  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from peaks import Peaks  # noqa: E402
from rounds import benchmark_parser, local_spark, write_json  # noqa: E402

_PROCESS = psutil.Process()


def big_result(size: int, kind: str) -> object:
    """Rank 0: ``size`` bytes, as ``bytes`` or as a NumPy array; the other ranks: nothing."""
    import os

    if int(os.environ["HOROVOD_RANK"]) != 0:
        return None
    if kind == "numpy":
        import numpy as np

        return np.full(size, 7, dtype=np.uint8)
    return b"\x07" * size


def measure(size: int, kind: str) -> dict[str, float]:
    gc.collect()
    with Peaks(rss=lambda: _PROCESS.memory_info().rss) as rss:
        started = time.perf_counter()
        result = HorovodRunner(np=2).run(big_result, size=size, kind=kind)
        seconds = time.perf_counter() - started
    assert len(result) == size  # type: ignore[arg-type]
    del result
    growth = rss.growth("rss")
    return {"seconds": seconds, "growth_mib": growth / 2**20, "times_result": growth / size}


def format_report(figures: dict[str, dict[str, float]], mib: int) -> str:
    """Per kind of result, the driver's growth in MiB and as a multiple of the result."""
    lines = [f"result of {mib} MiB, HorovodRunner(np=2) on local[2]: driver Python RSS growth"]
    lines += [
        f"  {kind:6} {figure['growth_mib']:8.0f} MiB  = {figure['times_result']:.2f}x the result"
        f"  ({figure['seconds']:.1f}s)"
        for kind, figure in figures.items()
    ]
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--kinds", default="bytes,numpy")
    options = parser.parse_args()
    spark = local_spark(2)
    try:
        HorovodRunner(np=2).run(big_result, size=1, kind="bytes")  # warm: the Python workers, the imports
        figures = {kind: measure(options.mib << 20, kind) for kind in options.kinds.split(",")}
    finally:
        spark.stop()
    print(format_report(figures, options.mib))
    write_json(options.json, {"mib": options.mib, **figures})


if __name__ == "__main__":
    main()
