"""The benchmarks (benchmarks/): each script imports, and what it prints and writes from recorded figures is
what it printed before its helpers moved to benchmarks/rounds.py. The benchmarks themselves are long (`make
bench` runs them); here each one with a peer runs once at a tiny size, and each of its peers must have run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from unittest import mock

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> SimpleNamespace:
    """Every benchmark module, imported as a script imports its neighbours (benchmarks/ on the path); the
    environment variables they set for their own runs, and the path, as they were."""
    path = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        with mock.patch.dict(os.environ):
            modules: dict[str, ModuleType] = {
                file.stem: importlib.import_module(file.stem) for file in sorted(BENCHMARKS.glob("*.py"))
            }
    finally:
        sys.path[:] = path
    return SimpleNamespace(**modules)


def launches(bench: SimpleNamespace, **times: list[float] | str) -> list:
    """One Method per name, with its recorded times, or (a string) the error it ended with."""
    methods = []
    for name, recorded in times.items():
        failed = isinstance(recorded, str)
        times_s, error = ([], recorded) if failed else (recorded, None)
        methods.append(bench.rounds.Method(name, f"label of {name}", lambda: None, times_s, error))
    return methods


def test_launch_figures_and_table(bench):
    methods = launches(
        bench,
        hr_spark=[2.95123, 3.1, 2.91],
        hvd_spark=[11.7812, 9.49, 12.0],
        floor=[2.77, 2.49, 3.0, 2.6],
        hr_local="RuntimeError: it broke",
    )
    figures = bench.rounds.launch_figures(methods, bench.launch.RATIOS, bench.launch.DIGITS)

    assert figures["methods"]["hr_spark"] == {
        "label": "label of hr_spark",
        "times_s": [2.9512, 3.1, 2.91],
        "median_s": 2.9512,
        "min_s": 2.91,
        "error": None,
    }
    assert figures["methods"]["hr_local"]["median_s"] is None
    assert figures["ratios"] == {"hr_spark/hvd_spark": 0.25, "hr_spark/floor": 1.1}
    assert bench.launch.format_table(figures, 3).splitlines() == [
        "launch overhead, 2 ranks, 3 repeats (after 1 warm-up each)",
        "method              median s  min s",
        "label of hr_spark       2.95  2.91",
        "label of hvd_spark     11.78  9.49",
        "label of floor          2.69  2.49",
        "label of hr_local        n/a  RuntimeError: it broke",
        "hr_spark/hvd_spark (median): 0.25x",
        "hr_spark/floor (median): 1.10x",
    ]


def test_torch_launch_report_without_pyspark(bench):
    methods = launches(bench, ours=[2.46, 2.5, 2.401], floor=[4.6, 4.4])  # --skip pyspark
    figures = {
        "repeats": 2,
        "launch": bench.rounds.launch_figures(methods, bench.torch_launch.RATIOS, bench.torch_launch.DIGITS),
        "training": {
            "steps": 1000,
            "methods": {
                "torchrun": {"steps_per_s": 500.0, "best_steps_per_s": 520.1},
                "ours": {"steps_per_s": 503.0, "best_steps_per_s": 530.0},
            },
            "ours/torchrun": 1.006,
        },
        "failure": {"ours": {"type": None}},
    }

    assert figures["launch"]["methods"]["ours"]["times_s"] == [2.46, 2.5, 2.401]
    assert bench.torch_launch.format_report(figures).splitlines() == [
        "launch of a trivial 2-process DDP job, 2 repeats (after 1 warm-up each)",
        f"  {'label of ours':<58} 2.46 s median, 2.40 s min",
        f"  {'label of floor':<58} 4.50 s median, 4.40 s min",
        "  ours/pyspark: n/a",
        "  ours/floor: 0.55x",
        "  pyspark/floor: n/a",
        "training: the same DDP MLP, 1000 steps, loop timed in rank 0",
        "  torchrun   500.0 steps/s median, 520.1 best",
        "  ours       503.0 steps/s median, 530.0 best",
        "  ours/torchrun: 1.006x",
        "a failing rank (rank 1 raises while rank 0 is in all_reduce)",
        '  ours       {"type": null}',
    ]


def test_scale_medians_and_table(bench):
    def round_(started_s: float | None, threads: int, rss_mb: float, in_order: bool = True) -> dict:
        started = {"all_started": started_s is not None, "started_s": started_s, "lines_in_order": in_order}
        return {**started, "abort_s": 0.2, "raised_s": 0.3, "threads": threads, "rss_mb": rss_mb}

    ok = [round_(0.5, 3, 10.5), round_(0.7, 5, 9.0), round_(0.6, 4, 12.25, in_order=False)]
    fail = [round_(0.4, 3, 11.0), round_(None, 6, 8.0)]  # a round where not every agent started: no median
    sizes = {100: {"ok": bench.scale.summarize(ok), "fail": bench.scale.summarize(fail)}}

    assert sizes[100]["ok"] == {  # medians, but the highest threads and RSS
        **{"started_s": 0.6, "abort_s": 0.2, "raised_s": 0.3, "threads": 5, "rss_mb": 12.25},
        **{"all_started": True, "lines_in_order": False},
    }
    assert sizes[100]["fail"]["started_s"] is None
    assert bench.scale.format_table({"spread_s": 0.0, "sizes": sizes}).splitlines()[1:] == [
        "| agents | all started | lines in order | last hello → all started s | abort fan-out s "
        "| failure → run() raised s | driver threads | driver RSS growth MB |",
        "|---|---|---|---|---|---|---|---|",
        "| 100 | False | False | 0.600 | 0.200 | 0.300 | +6 | 12.2 |",
        "goal at 1,000: started ≤ 5.0 s, aborted ≤ 2.0 s, RSS < 300 MB",
    ]


def test_payload_medians_and_table(bench):
    runs = {
        0: [{"seconds": 2.1, "sent_mb": 0.01, "sent_x": None}] * 3,  # too small to say a multiple of
        20: [{"seconds": 3.1, "sent_mb": 20.1, "sent_x": 1.01}, {"seconds": 2.9, "sent_mb": 20.3, "sent_x": 1.02}],
    }
    rows = [
        {"cluster": "local[2]", "np": 2, "size_mb": size, "method": "HorovodRunner", "python_rss_mb": 41.4}
        | {"jvm_rss_mb": 5.5}
        | {key: bench.rounds.median([r[key] for r in results], bench.payload.DIGITS) for key in results[0]}
        for size, results in runs.items()
    ]

    assert bench.payload.format_table(rows).splitlines() == [
        "| run | argument | method | launch s | driver sent MB | × payload | driver Python RSS +MB "
        "| driver JVM RSS +MB |",
        "|---|---|---|---|---|---|---|---|",
        "| np=2 local[2] | 0 MB | HorovodRunner | 2.10 | 0.0 | n/a | 41 | 6 |",
        "| np=2 local[2] | 20 MB | HorovodRunner | 3.00 | 20.2 | 1.02× | 41 | 6 |",
    ]


def test_connect_launch_report(bench):
    methods = launches(bench, classic=[4.46, 3.77, 5.0], connect=[5.59, 4.44, 6.0])
    assert bench.connect_launch.format_report(bench.connect_launch.connect_figures(methods)).splitlines() == [
        "classic  median 4.46s  min 3.77s  (label of classic)",
        "connect  median 5.59s  min 4.44s  (label of connect)",
        "connect / classic (median): 1.25",
    ]
    methods = launches(bench, classic=[4.46], connect="RuntimeError: no server")
    assert bench.connect_launch.format_report(bench.connect_launch.connect_figures(methods)).splitlines() == [
        "classic  median 4.46s  min 4.46s  (label of classic)",
        "connect  n/a: RuntimeError: no server",
    ]


def test_logs_table(bench):
    results = [
        bench.logs.Result("HorovodRunner(np=2)", 8.8, 2_000_000, 0, 0, 0.9),
        bench.logs.Result("HorovodRunner(np=-2)", 6.1, 1_999_000, 1000, 0, 19.3),
        bench.logs.Result("floor (2 processes -> pipes -> file)", 4.7, 2_000_000, 0, 0, 0.0),
    ]
    assert bench.logs.format_table(results, 1_000_000).splitlines() == [
        "rank-log relay: 2 ranks x 1,000,000 lines, verbosity 'all', lines written to a log file",
        "method                                  seconds    lines/s  dropped  lost  RSS +MB",
        "HorovodRunner(np=2)                         8.8    227,273        0     0      0.9",
        "HorovodRunner(np=-2)                        6.1    327,705    1,000     0     19.3",
        "floor (2 processes -> pipes -> file)        4.7    425,532        0     0      0.0",
        "HorovodRunner(np=2): 0.53x the floor's rate",
        "HorovodRunner(np=-2): 0.77x the floor's rate",
    ]


def test_result_memory_report(bench):
    figures = {"bytes": {"seconds": 3.25, "growth_mib": 1090.4, "times_result": 1.0648}}
    assert bench.result_memory.format_report(figures, 1024).splitlines() == [
        "result of 1024 MiB, HorovodRunner(np=2) on local[2]: driver Python RSS growth",
        "  bytes      1090 MiB  = 1.06x the result  (3.2s)",
    ]


@pytest.mark.parametrize(
    "name", ["launch", "torch_launch", "connect_launch", "durable_launch", "durable_retry", "scale", "payload"]
)
def test_no_rounds_is_refused_before_anything_starts(bench, name, capsys):
    with pytest.raises(SystemExit) as exited:
        getattr(bench, name).main(["--repeats", "0"])
    assert exited.value.code == 2
    assert "argument --repeats: must be at least 1, not 0" in capsys.readouterr().err


def test_figures_are_written_as_json_where_asked(bench, tmp_path):
    bench.rounds.write_json(str(tmp_path / "figures.json"), {"ratios": {"hr_spark/floor": 1.1}})
    bench.rounds.write_json(None, {"not": "written"})
    assert (tmp_path / "figures.json").read_text() == '{\n  "ratios": {\n    "hr_spark/floor": 1.1\n  }\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]


def test_durable_launch_report(bench):
    methods = launches(bench, run=[5.0, 4.0, 6.0], **{"submit+wait": [7.5, 7.0, 8.0]})
    figures = bench.connect_launch.connect_figures(methods)
    figures["attach"] = {"label": "label of attach", "median_s": 3.0, "min_s": 2.5, "runs": [3.0, 2.5, 3.5]}
    assert bench.durable_launch.format_report(figures).splitlines() == [
        "run          median 5.00s  min 4.00s  (label of run)",
        "submit+wait  median 7.50s  min 7.00s  (label of submit+wait)",
        "attach       median 3.00s  min 2.50s  (label of attach)",
        "submit+wait / run (median): 1.50",
    ]


# Each benchmark that sets ours beside a peer, run as `make bench` runs it, at a tiny size: the arguments, and the
# methods (ours and its peers) whose figures its JSON must hold. A method that did not run has none (it is n/a in
# the benchmark's table, and the benchmark exits 1).
def _launch_ran(figures: dict) -> set[str]:
    return {name for name, info in figures["methods"].items() if info["median_s"] is not None}


PEERS = {
    "launch": (["--check"], _launch_ran, {"hr_spark", "hvd_spark", "floor", "hr_local"}),
    "torch_launch": (
        ["--check", "--steps", "2"],
        lambda f: (
            _launch_ran(f["launch"])
            | {f"{name} training" for name, info in f["training"]["methods"].items() if "error" not in info}
            | {f"{name} failing" for name, info in f["failure"].items() if info["type"]}
        ),
        {"ours", "pyspark", "floor"}
        | {f"{name} training" for name in ("ours", "pyspark", "torchrun", "ours_local")}
        | {f"{name} failing" for name in ("ours", "pyspark", "torchrun")},
    ),
    "payload": (
        ["--check", "--sizes", "0", "--clusters", "local"],
        lambda rows: {row["method"] for row in rows},
        {"HorovodRunner", "horovod.spark.run"},
    ),
    "logs": (
        ["--lines", "10"],
        lambda results: {r["method"] for r in results if r["relayed"] == 20},
        {"HorovodRunner(np=2)", "HorovodRunner(np=-2)", "floor (2 processes -> pipes -> file)"},
    ),
    "dataframe_feed": (
        ["--rows", "2000", "--shard-mib", "1"],
        lambda f: {name for name in ("ours", "pyspark", "limit") if f[name]["rows_per_s"] > 0},
        {"ours", "pyspark", "limit"},
    ),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", PEERS)
def test_each_benchmark_runs_ours_and_each_of_its_peers(name, tmp_path):
    arguments, ran, expected = PEERS[name]
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *arguments, "--json", str(figures)],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS.parent,
        timeout=840,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert expected <= ran(json.loads(figures.read_text())), done.stdout[-3000:]
