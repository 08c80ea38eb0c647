"""Before anything starts, the pickled job is sized, a large one is warned about by its parts, an unpicklable
object is named by where it sits; a rank-0 result too large for a channel frame is refused clearly (the job
does not travel over the channel: no frame limit applies to it)."""

from __future__ import annotations

import logging
import threading
import types
from pathlib import Path

import jobs
import pytest

import airflow_provider_hvd
from airflow_provider_hvd import HorovodRunner, RankFailedError
from airflow_provider_hvd.runner.shared import payload, wire
from airflow_provider_hvd.runner.shared.payload import MAX_FRAME_ENV

BIG_BLOB = bytes(12_000_000)  # over the default 10 MB warning threshold
MODULE_LOCK = threading.Lock()


class Connection:
    def __init__(self) -> None:
        self.url = "db://warehouse"
        self._lock = threading.Lock()


CONNECTION = Connection()
SETTINGS = {"retries": 3, "pool": {"size": 4, "lock": threading.Lock()}}


def blob_length() -> int:
    return len(BIG_BLOB)


def uses_module_lock() -> int:
    with MODULE_LOCK:
        return 1


def uses_connection() -> str:
    return CONNECTION.url


def uses_settings() -> int:
    return SETTINGS["retries"]


def uses_argument(conn: Connection) -> str:
    return conn.url


def closure_over_connection():
    conn = Connection()

    def query() -> str:
        return conn.url

    return query


def count_rows(rows: bytes) -> int:
    return len(rows)


def big_result(size: int) -> bytes:
    return bytes(size)


def payload_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "airflow_provider_hvd.runner" and r.levelno == level and "the pickled job is" in r.getMessage()
    ]


def test_big_global_is_warned_about_by_name_with_its_size(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd.runner")
    assert HorovodRunner(np=-2).run(blob_length) == 12_000_000  # warned, not refused: it still runs
    [info] = payload_records(caplog, logging.INFO)
    assert "main (blob_length) 12.0 MB, its arguments" in info
    [warning] = payload_records(caplog, logging.WARNING)
    assert "the pickled job is 12.0 MB (over 10.0 MB)" in warning
    assert "Largest parts: main → global 'BIG_BLOB': 12.0 MB." in warning
    assert "load large data inside main" in warning and "pass its path" in warning


def test_closure_variable_and_argument_are_named_above_the_runner_s_threshold(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd.runner")
    lookup = bytes(300_000)

    def count(rows: bytes) -> int:
        return len(lookup) + len(rows)

    runner = HorovodRunner(np=-2)
    runner.payload_warning_bytes = 400_000
    assert runner.run(count, rows=bytes(200_000)) == 500_000
    [warning] = payload_records(caplog, logging.WARNING)
    assert "(over 400.0 KB)" in warning
    assert "Largest parts: main → closure variable 'lookup': 300.0 KB; argument 'rows': 200.0 KB." in warning
    assert HorovodRunner.payload_warning_bytes == 10_000_000


@pytest.mark.parametrize(
    ("main", "kwargs", "path"),
    [
        (uses_module_lock, {}, "main → global 'MODULE_LOCK'"),
        (uses_connection, {}, "main → global 'CONNECTION' → attribute '_lock'"),
        (uses_settings, {}, "main → global 'SETTINGS' → key 'pool' → key 'lock'"),
        (closure_over_connection(), {}, "main → closure variable 'conn' → attribute '_lock'"),
        (uses_argument, {"conn": Connection()}, "argument 'conn' → attribute '_lock'"),
    ],
    ids=["module-lock", "attribute", "dict-value", "closure", "argument"],
)
def test_unpicklable_object_is_named_with_its_path(main, kwargs, path):
    with pytest.raises(TypeError) as info:
        HorovodRunner(np=-2).run(main, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{path} is a _thread.lock, which cannot be pickled to travel to the ranks")
    assert "create it inside main, or pass what is needed to build it there" in message
    assert "cannot pickle '_thread.lock' object" in str(info.value.__cause__)  # the original, chained


@pytest.mark.parametrize("np", [-2, 2])
def test_a_job_larger_than_a_channel_frame_runs(spark_local, monkeypatch, np):
    """The job does not travel over the driver channel: a Spark broadcast, or locally the driver's own copy."""
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 1_000_000)
    assert HorovodRunner(np=np).run(count_rows, rows=bytes(2_000_000)) == 2_000_000


def test_result_larger_than_a_frame_is_refused_clearly(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd.runner")
    monkeypatch.setenv(MAX_FRAME_ENV, "100000")  # read by the driver and by the rank processes
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(big_result, size=1_000_000)
    assert info.value.rank == 0
    assert (
        "rank 0 of 2 failed: ValueError: rank 0's return value pickles to 1.0 MB, more than the 100.0 KB the "
        "driver channel carries in one frame; save it where the driver can read it and return its path"
    ) in str(info.value)
    assert len(payload_records(caplog, logging.INFO)) == 1 and not payload_records(caplog, logging.WARNING)


def test_an_installed_package_beside_main_is_not_shipped_by_value():
    """A script in a project's root, beside the project's own package installed in editable mode: the ranks
    import the package (by value, its module state would be a copy), while a plain helper module travels."""
    root = Path(airflow_provider_hvd.__file__).resolve().parent.parent
    script = types.ModuleType("__main__")
    script.__file__ = str(root / "train.py")
    beside = {module.__name__ for module in payload.modules_beside(script)}
    assert not {name for name in beside if name.startswith("airflow_provider_hvd")}, beside
    assert jobs.__name__ in beside  # tests/jobs.py: a module of the project's, not installed


def test_a_module_the_user_registered_by_value_stays_registered_after_a_run():
    """Before: the run unregistered it, and the user's own pickling by value of jobs.py stopped working after it."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(jobs)
    try:
        assert HorovodRunner(np=-2).run(jobs._record_pid, pid_dir=None, rank=0) is None  # (a main that imports nothing)
        assert jobs.__name__ in cloudpickle.list_registry_pickle_by_value()
    finally:
        cloudpickle.unregister_pickle_by_value(jobs)
