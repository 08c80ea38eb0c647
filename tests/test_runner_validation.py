"""Bad input is refused before anything starts, with an error that names the problem: a ConfigurationError (no
retry can fix it; the Airflow operators fail the task without its retries), and the ValueError, TypeError or
LaunchError it always was."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from jobs import allreduce_sum

from airflow_provider_hvd import ConfigurationError, HorovodRunner, LaunchError


@contextlib.contextmanager
def refused(kind: type[Exception], match: str) -> Iterator[None]:
    """``pytest.raises(kind, match=match)``, of an error that is a ConfigurationError too."""
    with pytest.raises(kind, match=match) as caught:
        yield
    assert isinstance(caught.value, ConfigurationError), repr(caught.value)


@pytest.mark.parametrize("np", [0, True, False, 2.0, "2", None])
def test_np_must_be_a_nonzero_int(np):
    with refused(ValueError, "np must be"):
        HorovodRunner(np=np)


def test_np_is_keyword_only():
    with pytest.raises(TypeError):
        HorovodRunner(2)  # type: ignore[misc]


def test_unknown_verbosity():
    with refused(ValueError, "driver_log_verbosity must be one of"):
        HorovodRunner(np=-2, driver_log_verbosity="verbose")


def test_kwargs_must_fit_main(spark_local):
    with refused(TypeError, "do not fit 'allreduce_sum'.*unexpected keyword argument 'nope'"):
        HorovodRunner(np=-2).run(allreduce_sum, nope=1)
    with refused(TypeError, "do not fit"):
        HorovodRunner(np=2).run(lambda a: a)


def test_main_must_be_callable():
    with refused(TypeError, "main must be callable"):
        HorovodRunner(np=-2).run("train.py")


def test_more_ranks_than_slots_fails_fast(spark_local):
    import time

    started = time.monotonic()
    with refused(LaunchError, r"np=3\) needs 3 Spark task slots .* has 2"):
        HorovodRunner(np=3).run(allreduce_sum)
    assert time.monotonic() - started < 10
    assert spark_local.sparkContext.statusTracker().getActiveJobsIds() == []


def test_a_run_without_a_spark_session_says_it_starts_one_on_local():
    """Before: HorovodRunner(np>0) with no SparkSession started one on local[*] without a word, and a run meant for
    a cluster ran on this host. Said even without logging set up (a warning reaches stderr)."""
    code = "from airflow_provider_hvd import HorovodRunner; HorovodRunner(np=64).run(print)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
    assert "HorovodRunner: no SparkSession is active: starting one on local[*], this host's cores. To run " in (
        done.stderr
    ), done.stderr[-3000:]
    assert "HorovodRunner(np=64) needs 64 Spark task slots at once" in done.stderr, done.stderr[-3000:]
