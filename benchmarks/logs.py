"""Throughput and memory of the rank-log relay, side by side with a raw-pipe floor.

Two ranks each print ``--lines`` lines (default 1,000,000) as fast as Python can, with
``driver_log_verbosity="all"``; the driver's ``airflow_provider_hvd.ranks`` logger writes every relayed
line to a file, as a task log would. Measured, per launch mode (``np=2`` on a warm ``local[2]``
SparkSession, and ``np=-2``):

- relayed lines per second (lines that reached the driver's logger / wall time of ``run``);
- lines lost: lines neither relayed nor reported as dropped (goal 0), and lines reported dropped;
- the driver process's peak RSS growth during the run (sampled every 10 ms; goal < 100 MB).

The floor: two plain subprocesses printing the same lines into pipes that this process reads line by
line and writes to a file: the cost of moving the text at all. Run::

    make bench                      # or: .venv/bin/python benchmarks/logs.py --lines 1000000
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import logging  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from airflow_provider_hvd import HorovodRunner  # noqa: E402
from airflow_provider_hvd.runner.driver.watch.channel import rank_log  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from peaks import Peaks  # noqa: E402
from rounds import benchmark_parser, local_spark, write_json  # noqa: E402

RANKS = 2
_PROCESS = psutil.Process()


def _peak_rss() -> Peaks:
    return Peaks(rss=lambda: _PROCESS.memory_info().rss)


PRINT_CODE = "import sys\nw = sys.stdout.write\nfor i in range({n}):\n    w(f'{{i}}\\n')\n"


def flood(lines: int) -> int:
    import sys

    import horovod.torch as hvd

    hvd.init()
    write = sys.stdout.write
    for i in range(lines):
        write(f"{i}\n")
    sys.stdout.flush()
    return lines


@dataclass
class Result:
    method: str
    seconds: float
    relayed: int
    dropped: int
    lost: int
    rss_growth_mb: float

    @property
    def lines_per_s(self) -> float:
        return self.relayed / self.seconds


class _Tally(logging.FileHandler):
    """Writes relayed lines to a file like a task log, and counts them and the reported drops."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.relayed = 0
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and "dropped" in record.msg:
            self.dropped += record.args[1]  # type: ignore[index]
        else:
            self.relayed += len(record.rank_lines)  # type: ignore[attr-defined]  # a record holds a batch of lines
        super().emit(record)


def relay(np: int, lines: int, log_path: str) -> Result:
    handler = _Tally(log_path)
    rank_log.addHandler(handler)
    rank_log.setLevel(logging.INFO)
    rank_log.propagate = False
    try:
        with _peak_rss() as rss:
            started = time.perf_counter()
            HorovodRunner(np=np, driver_log_verbosity="all").run(flood, lines=lines)
            seconds = time.perf_counter() - started
    finally:
        rank_log.removeHandler(handler)
        rank_log.propagate = True
        handler.close()
    expected = RANKS * lines
    lost = expected - handler.relayed - handler.dropped
    return Result(f"HorovodRunner(np={np})", seconds, handler.relayed, handler.dropped, lost, rss.growth("rss") / 2**20)


def floor(lines: int, log_path: str) -> Result:
    procs = [
        subprocess.Popen([sys.executable, "-c", PRINT_CODE.format(n=lines)], stdout=subprocess.PIPE)
        for _ in range(RANKS)
    ]
    counts = [0] * RANKS
    lock = threading.Lock()

    def read(i: int, out) -> None:
        with open(log_path, "a") as log:
            for raw in out:
                line = raw.decode().rstrip("\n")
                with lock:
                    log.write(f"[rank {i}] {line}\n")
                counts[i] += 1

    with _peak_rss() as rss:
        started = time.perf_counter()
        readers = [threading.Thread(target=read, args=(i, p.stdout)) for i, p in enumerate(procs)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        for p in procs:
            p.wait()
        seconds = time.perf_counter() - started
    relayed = sum(counts)
    return Result(
        "floor (2 processes -> pipes -> file)", seconds, relayed, 0, RANKS * lines - relayed, rss.growth("rss") / 2**20
    )


def format_table(results: list[Result], lines: int) -> str:
    """The methods side by side, the floor last, and each other's rate over the floor's."""
    rows = [
        f"rank-log relay: {RANKS} ranks x {lines:,} lines, verbosity 'all', lines written to a log file",
        f"{'method':38} {'seconds':>8} {'lines/s':>10} {'dropped':>8} {'lost':>5} {'RSS +MB':>8}",
    ]
    for r in results:
        rows.append(
            f"{r.method:38} {r.seconds:8.1f} {r.lines_per_s:10,.0f} {r.dropped:8,} {r.lost:5,} {r.rss_growth_mb:8.1f}"
        )
    floor_rate = results[-1].lines_per_s
    rows += [f"{r.method}: {r.lines_per_s / floor_rate:.2f}x the floor's rate" for r in results[:-1]]
    return "\n".join(rows)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines printed by each rank")
    args = parser.parse_args()
    logging.getLogger("airflow_provider_hvd").setLevel(logging.WARNING)
    rank_log.setLevel(logging.INFO)

    spark = local_spark(2)
    HorovodRunner(np=2).run(flood, lines=10)  # warm the Python workers
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, measure in (
            ("spark", lambda path: relay(2, args.lines, path)),
            ("local", lambda path: relay(-2, args.lines, path)),
            ("floor", lambda path: floor(args.lines, path)),
        ):
            results.append(measure(os.path.join(tmp, f"{name}.log")))
    spark.stop()

    print(f"\n{format_table(results, args.lines)}")
    write_json(args.json, [{**asdict(r), "lines_per_s": r.lines_per_s} for r in results])


if __name__ == "__main__":
    main()
