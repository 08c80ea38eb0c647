"""Progress writes that go wrong: a sink that fails for a while, a sink that hangs, a rank killed mid-save."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from airflow_provider_hvd import HorovodRunner, RankFailedError, RunCancelledError


def report_then_finish(marker: str, wait_s: float) -> int:
    """Rank 0 reports a checkpoint and a metric, waits ``wait_s``, then creates ``marker``; both ranks return."""
    import pathlib
    import time

    import horovod.torch as hvd

    from airflow_provider_hvd import log_metrics, report_checkpoint

    hvd.init()
    if hvd.rank() == 0:
        log_metrics(1, loss=0.5)
        report_checkpoint("/ckpt/epoch-1.pt", epoch=1)
        time.sleep(wait_s)
        pathlib.Path(marker).touch()
    hvd.broadcast_object(0)
    return hvd.rank()


def rank1_fails_after(seconds: float) -> None:
    """Rank 0 reports a metric and trains on; rank 1 raises ``seconds`` in."""
    import time

    import horovod.torch as hvd

    from airflow_provider_hvd import log_metrics

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(seconds)
        raise RuntimeError("rank 1 failed")
    log_metrics(1, loss=0.5)
    time.sleep(120)


class DownUntil:
    """A sink that raises (a store unreachable) until ``marker`` exists, then keeps every write."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.failed = {"metrics": 0, "checkpoint": 0}
        self.kept: dict[str, list[dict]] = {"metrics": [], "checkpoint": []}

    def _write(self, key: str, value: dict) -> None:
        if not os.path.exists(self.marker):
            self.failed[key] += 1
            raise ConnectionError("the store is unreachable")
        self.kept[key].append(value)

    def metrics(self, snapshot: dict) -> None:
        self._write("metrics", snapshot)

    def checkpoint(self, record: dict) -> None:
        self._write("checkpoint", record)


class HangingMetrics:
    """A sink whose metrics() blocks (an API server that does not answer) until released or 60 s have passed."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def metrics(self, snapshot: dict) -> None:
        self.entered.set()
        self.released.wait(60)

    def checkpoint(self, record: dict) -> None:
        pass


def progress_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "the run's progress" in r.getMessage()
    ]


def test_a_failed_write_is_retried_and_the_last_checkpoint_reaches_the_sink_when_it_answers(tmp_path, caplog):
    """The store is down from the first report until rank 0 is done: retried with backoff, written at the end."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    marker = str(tmp_path / "answering")
    sink = DownUntil(marker)
    runner = HorovodRunner(np=-2, progress_sink=sink)
    runner.progress_interval_s = 0.25
    assert runner.run(report_then_finish, marker=marker, wait_s=3.0) == 0
    assert [record["path"] for record in sink.kept["checkpoint"]] == ["/ckpt/epoch-1.pt"]
    assert sink.kept["checkpoint"][-1]["epoch"] == 1
    assert sink.kept["metrics"][-1]["series"]["loss"] == [[1, 0.5]]
    # retried while the run went on, with backoff (1 s, 2 s...), not at every interval (12 tries in 3 s)
    assert 2 <= sink.failed["checkpoint"] <= 5, sink.failed
    assert 2 <= sink.failed["metrics"] <= 5, sink.failed
    assert len(progress_warnings(caplog)) == 1, progress_warnings(caplog)


@pytest.mark.parametrize("ending", ["rank 1 fails", "cancel()"])
def test_a_hung_progress_store_does_not_hold_up_the_runs_end(ending, caplog):
    """metrics() blocks 60 s; rank 1 fails 4 s in, or the run is cancelled once the write hangs: run() raises
    within seconds, with one warning."""
    sink = HangingMetrics()
    runner = HorovodRunner(np=-2, progress_sink=sink)
    started = time.monotonic()
    try:
        if ending == "cancel()":  # once the write hangs
            canceller = threading.Thread(target=lambda: sink.entered.wait(60) and runner.cancel())
            canceller.start()
            with pytest.raises(RunCancelledError):
                runner.run(rank1_fails_after, seconds=120.0)
            canceller.join()
        else:
            with pytest.raises(RankFailedError, match="rank 1 failed"):
                runner.run(rank1_fails_after, seconds=4.0)
        took = time.monotonic() - started
    finally:
        sink.released.set()
    assert took < 30, f"run() waited on the progress store: it raised after {took:.1f}s"
    warnings = progress_warnings(caplog)
    assert len(warnings) == 1 and "did not answer" in warnings[0], warnings


def keras_killed_mid_save(path: str) -> None:
    """Keras fit with a fixed CheckpointCallback path; rank 0 is SIGKILLed half-way through its second save."""
    import os
    import signal

    import keras
    import numpy as np
    from keras.src.saving import saving_lib

    from airflow_provider_hvd.horovod.keras import CheckpointCallback

    save = saving_lib._save_model_to_fileobj
    saves = []

    def killed_in_the_second(model, fileobj, weights_format):
        saves.append(1)
        if len(saves) == 2:
            fileobj.write(b"PK\x03\x04 half a model")
            fileobj.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return save(model, fileobj, weights_format)

    saving_lib._save_model_to_fileobj = killed_in_the_second
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model.fit(x, (x[:, 0] > 0).astype("float32"), epochs=3, verbose=0, callbacks=[CheckpointCallback(path)])


def test_a_rank_killed_mid_save_leaves_the_last_checkpoint_whole(tmp_path):
    import keras

    path = str(tmp_path / "model.keras")
    runner = HorovodRunner(np=-2)
    with pytest.raises(RankFailedError):
        runner.run(keras_killed_mid_save, path=path)
    assert runner.checkpoint is not None and runner.checkpoint["path"] == path and runner.checkpoint["epoch"] == 1
    keras.saving.load_model(path)  # the epoch-1 model, whole (the killed save's temporary file is beside it)


def test_no_write_starts_once_the_runs_end_gave_up_on_a_hung_store(monkeypatch, caplog):
    """The checkpoint's write hangs past the run's end: the end gives up on it, and when the store answers at
    last, the metrics still due are not written after the run (they could overwrite what the task recorded
    since, e.g. the checkpoint marked finished)."""
    from airflow_provider_hvd.runner.driver.tracking import progress
    from airflow_provider_hvd.runner.shared.messages import Checkpoint, Metrics

    monkeypatch.setattr(progress, "FINAL_WRITE_S", 0.5)
    answer = threading.Event()
    written: list[str] = []

    class HungSink:
        def checkpoint(self, record):
            written.append("checkpoint")
            answer.wait(30)

        def metrics(self, snapshot):
            written.append("metrics")

    run = progress.RunProgress(0, HungSink(), interval_s=0)
    run.take(0, Checkpoint("/ckpt/epoch-1.pt", {"epoch": 1}, time.time()))
    run.take(0, Metrics(1, {"loss": 0.5}, time.time()))
    with caplog.at_level(logging.WARNING, logger="airflow_provider_hvd.runner"):
        run.flush()
    assert "did not answer within" in caplog.text, caplog.text
    answer.set()
    run._writer.join(10)
    assert not run._writer.is_alive()
    assert written == ["checkpoint"]
