"""Progress as data with HorovodRunner alone: log_metrics, report_checkpoint, last_checkpoint, resume_from."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest
from progress_jobs import log_many_metrics, train_resumable

from airflow_provider_hvd import HorovodRunner, RankFailedError, last_checkpoint, log_metrics, report_checkpoint
from airflow_provider_hvd.runner.driver.tracking.progress import MetricSeries, MetricsHistory
from airflow_provider_hvd.runner.settings import SNAPSHOT_MAX_BYTES


class RecordingSink:
    """A ProgressSink that keeps every write, with when it came."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, str, dict]] = []

    def metrics(self, snapshot: dict) -> None:
        self.writes.append((time.monotonic(), "metrics", json.loads(json.dumps(snapshot))))

    def checkpoint(self, record: dict) -> None:
        self.writes.append((time.monotonic(), "checkpoint", json.loads(json.dumps(record))))

    def last(self, key: str) -> dict:
        return [value for _, kind, value in self.writes if kind == key][-1]


def test_a_failed_run_resumes_from_its_last_checkpoint_and_ends_with_the_same_model(tmp_path):
    """The recipe for HorovodRunner alone: the failed runner's .checkpoint is the next runner's resume_from."""
    (tmp_path / "a").mkdir()
    never_failed = HorovodRunner(np=-2).run(train_resumable, ckpt_dir=str(tmp_path / "a"))
    assert never_failed["resumed_from"] is None and never_failed["epochs_trained"] == [1, 2, 3, 4, 5, 6]

    (tmp_path / "b").mkdir()
    first = HorovodRunner(np=-2)
    with pytest.raises(RankFailedError, match="simulated failure after epoch 3"):
        first.run(train_resumable, ckpt_dir=str(tmp_path / "b"), fail_after_epoch=3)
    assert first.checkpoint is not None
    assert first.checkpoint["path"] == str(tmp_path / "b" / "epoch-3.pt")
    assert first.checkpoint["epoch"] == 3 and first.checkpoint["rank"] == 0
    assert [step for step, _ in first.metrics["loss"]] == [1, 2, 3]

    resumed = HorovodRunner(np=-2, resume_from=first.checkpoint).run(train_resumable, ckpt_dir=str(tmp_path / "b"))
    assert resumed["resumed_from"]["path"] == first.checkpoint["path"]
    assert resumed["resumed_from"]["epoch"] == 3
    assert resumed["epochs_trained"] == [4, 5, 6]
    assert resumed["weights_sha256"] == never_failed["weights_sha256"]
    assert resumed["loss"] == never_failed["loss"]


def test_metrics_history_is_rank0s_and_the_sink_gets_it_at_most_once_per_interval():
    sink = RecordingSink()
    runner = HorovodRunner(np=-2, progress_sink=sink)
    runner.progress_interval_s = 1.0
    assert runner.run(log_many_metrics, reports=40, pause_s=0.1) == 40
    losses = runner.metrics["loss"]
    assert [step for step, _ in losses] == list(range(40))
    assert losses[0][1] == 1.0, "rank 0's values (rank 1 reports 1 more)"
    assert runner.metrics["lr"][3] == (3, None), "NaN is a gap"
    metric_writes = [at for at, kind, _ in sink.writes if kind == "metrics"]
    assert len(metric_writes) >= 2, "written while the run went on, not only at the end"
    # the last write is the final flush
    gaps = [later - earlier for earlier, later in itertools.pairwise(metric_writes[:-1])]
    assert all(gap >= 1.0 for gap in gaps), gaps
    final = sink.last("metrics")
    assert final["rank"] == 0 and final["reports"] == 40
    assert final["series"]["loss"][-1] == [39, 0.025]
    assert runner.checkpoint is None


def test_last_checkpoint_reaches_every_rank_from_resume_from(tmp_path):
    def read_it() -> list:
        import horovod.torch as hvd

        from airflow_provider_hvd import last_checkpoint

        hvd.init()
        return hvd.allgather_object(last_checkpoint())

    assert HorovodRunner(np=-2).run(read_it) == [None, None]
    seen = HorovodRunner(np=-2, resume_from=str(tmp_path / "x.pt")).run(read_it)
    assert seen == [{"try_number": None, "path": str(tmp_path / "x.pt")}] * 2
    with pytest.raises(TypeError, match="resume_from must be None, a checkpoint's path, or a dict with a 'path'"):
        HorovodRunner(np=-2, resume_from={"epoch": 3})


def test_the_history_stays_bounded_and_even():
    series = MetricSeries(max_points=100)
    for step in range(100_000):
        series.add(step, float(step))
    points = series.points()
    assert len(points) <= 101 and points[-1] == (99_999, 99_999.0)
    steps = [step for step, _ in points[:-1]]
    assert len({b - a for a, b in itertools.pairwise(steps)}) == 1, "evenly spread over the reports"
    assert steps[0] == 0


def test_a_snapshot_fits_the_task_state_stores_value_limit_however_long_the_run():
    history = MetricsHistory()
    for step in range(50_000):
        history.add(step, {f"metric_{i:02d}_{'x' * 80}": step * 1.234567891 + i for i in range(64)})
    history.add(50_000, {"one_too_many": 1.0})
    snapshot = history.snapshot()
    size = len(json.dumps(snapshot))
    assert size <= SNAPSHOT_MAX_BYTES, size
    assert snapshot["thinned_by"] > 1 and snapshot["reports"] == 50_001
    assert "one_too_many" in snapshot["left_out"]
    for points in snapshot["series"].values():
        assert points[-1][0] == 49_999, "each curve still ends at its last report"

    small = MetricsHistory()
    for step in range(10):
        small.add(step, {"loss": 1 / 3})
    assert small.snapshot()["series"]["loss"] == [[step, 0.333333] for step in range(10)]
    assert small.snapshot()["thinned_by"] == 1


def test_bad_reports_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"loss='low' is not a number; pass a float \(e.g. loss.item\(\)\)"):
        log_metrics(1, loss="low")
    with pytest.raises(TypeError, match="step must be a finite number"):
        log_metrics("epoch 1", loss=0.1)
    with pytest.raises(ValueError, match=r"\['rank', 'try_number'\] are set by the driver; name the info differently"):
        report_checkpoint("/x", try_number=2, rank=1)
    with pytest.raises(TypeError, match="info must be JSON"):
        report_checkpoint("/x", model=object())


def test_outside_a_job_metrics_and_checkpoints_are_printed(capsys, monkeypatch):
    monkeypatch.delenv("HVD_RUNNER_LAST_CHECKPOINT", raising=False)
    log_metrics(2, loss=0.5)
    report_checkpoint("/tmp/c.pt", epoch=2)
    assert capsys.readouterr().out.splitlines() == ["step 2: loss=0.5", 'checkpoint /tmp/c.pt {"epoch": 2}']
    assert last_checkpoint() is None


def test_importing_the_package_imports_no_framework():
    code = (
        "import sys, airflow_provider_hvd, airflow_provider_hvd.horovod; "
        "from airflow_provider_hvd import log_metrics, report_checkpoint, last_checkpoint; "
        "heavy = [m for m in ('torch', 'pyspark', 'horovod.torch', 'keras', 'airflow') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keras_callbacks_report_metrics_and_checkpoints_and_resume(tmp_path):
    from progress_jobs import keras_fit_resumable

    path = str(tmp_path / "epoch-{epoch}.keras")
    first = HorovodRunner(np=-2)
    assert first.run(keras_fit_resumable, path=path, epochs=3) == {"epochs_run": [1, 2, 3]}
    assert [step for step, _ in first.metrics["loss"]] == [1, 2, 3]
    assert set(first.metrics) == {"loss", "accuracy"}
    assert first.checkpoint["path"] == str(tmp_path / "epoch-3.keras") and first.checkpoint["epoch"] == 3
    assert (tmp_path / "epoch-3.keras").is_file() and first.checkpoint["rank"] == 0

    second = HorovodRunner(np=-2, resume_from=first.checkpoint)
    assert second.run(keras_fit_resumable, path=path, epochs=5) == {"epochs_run": [4, 5]}
    assert [step for step, _ in second.metrics["loss"]] == [4, 5]


def test_a_chart_is_one_svg_path_per_metric_with_gaps_where_values_are_missing():
    from airflow_provider_hvd.plugins.charts import chart_svg

    svg = chart_svg("loss <b>", [[1, 0.9], [2, 0.5], [3, None], [4, 0.3], [5, 0.2]])
    d = svg.split(' d="')[1].split('"')[0]
    assert [command[0] for command in d.split()] == ["M", "L", "M", "L"], d
    assert "loss &lt;b&gt;" in svg and "last: 0.2 at step 5" in svg
    assert 'class="curve"' not in chart_svg("empty", [[1, None]])
