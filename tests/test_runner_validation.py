"""Bad input is refused before anything starts, with an error that names the problem."""

from __future__ import annotations

import pytest
from jobs import allreduce_sum

from airflow_provider_hvd import HorovodRunner, LaunchError


@pytest.mark.parametrize("np", [0, True, False, 2.0, "2", None])
def test_np_must_be_a_nonzero_int(np):
    with pytest.raises(ValueError, match="np must be"):
        HorovodRunner(np=np)


def test_np_is_keyword_only():
    with pytest.raises(TypeError):
        HorovodRunner(2)  # type: ignore[misc]


def test_unknown_verbosity():
    with pytest.raises(ValueError, match="driver_log_verbosity must be one of"):
        HorovodRunner(np=-2, driver_log_verbosity="verbose")


def test_kwargs_must_fit_main(spark_local):
    with pytest.raises(TypeError, match="do not fit 'allreduce_sum'.*unexpected keyword argument 'nope'"):
        HorovodRunner(np=-2).run(allreduce_sum, nope=1)
    with pytest.raises(TypeError, match="do not fit"):
        HorovodRunner(np=2).run(lambda a: a)


def test_main_must_be_callable():
    with pytest.raises(TypeError, match="main must be callable"):
        HorovodRunner(np=-2).run("train.py")


def test_more_ranks_than_slots_fails_fast(spark_local):
    import time

    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"np=3\) needs 3 Spark task slots .* has 2"):
        HorovodRunner(np=3).run(allreduce_sum)
    assert time.monotonic() - started < 10
    assert spark_local.sparkContext.statusTracker().getActiveJobsIds() == []
