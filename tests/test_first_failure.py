"""Real training, one rank raises: the run names that rank, with its own traceback, whichever report comes first.

When a rank raises, the others are inside an allreduce; Horovod shuts down under them, and their
``HorovodInternalError`` may reach the driver before the failing rank's own report. Each rank in turn is the
one that raises, several times, on local ranks and on Spark.
"""

from __future__ import annotations

import pytest
from jobs import allreduce_until_failure

from airflow_provider_hvd import HorovodRunner, RankFailedError

REPEATS = 2  # each rank raises twice per configuration: 14 runs; the defect showed in 9 of 21 runs before
FAIL_AT = 5


def assert_blames(error: RankFailedError, bad_rank: int, size: int) -> None:
    message = str(error)
    assert error.rank == bad_rank, message
    first_line = message.splitlines()[0]
    assert (
        first_line
        == f"Horovod rank {bad_rank} of {size} failed: ValueError: boom from rank {bad_rank} at step {FAIL_AT}"
    )
    assert error.remote_traceback is not None, message
    assert error.remote_traceback.rstrip().endswith(f"ValueError: boom from rank {bad_rank} at step {FAIL_AT}")
    assert "in allreduce_until_failure" in error.remote_traceback
    others = sorted(int(line.split()[1].rstrip(":")) for line in error.other_failures)
    assert others == [rank for rank in range(size) if rank != bad_rank], message
    for line in error.other_failures:  # each a consequence of the cause, or ended by the driver because of it
        assert line.endswith((f"(a consequence of rank {bad_rank}'s failure)", f"(rank {bad_rank} failed)")), line


def run_failing(np: int, bad_rank: int) -> RankFailedError:
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=np).run(allreduce_until_failure, bad_rank=bad_rank, fail_at=FAIL_AT)
    return info.value


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize(("np", "bad_rank"), [(-2, 0), (-2, 1), (-3, 0), (-3, 1), (-3, 2)])
def test_local_run_names_the_rank_that_raised(np, bad_rank, repeat):
    assert_blames(run_failing(np, bad_rank), bad_rank, -np)


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_spark_run_names_the_rank_that_raised(spark_local, bad_rank, repeat):
    assert_blames(run_failing(2, bad_rank), bad_rank, 2)
