"""A big argument arrives intact on every rank, whichever way the job travels (a Spark broadcast for np > 0,
the driver's own copy for np < 0)."""

from __future__ import annotations

import hashlib
import os

import pytest

from airflow_provider_hvd import HorovodRunner

BIG = 200_000_000


def digests(blob: bytes) -> list[tuple[int, str]]:
    """Every rank's length and SHA-256 of the ``blob`` it received (rank 0 returns them all)."""
    import hashlib

    import horovod.torch as hvd

    hvd.init()
    return hvd.allgather_object((len(blob), hashlib.sha256(blob).hexdigest()))


@pytest.fixture(scope="module")
def blob() -> bytes:
    return os.urandom(BIG)  # incompressible: what Spark's broadcast carries is the whole of it


def expected(blob: bytes, ranks: int) -> list[tuple[int, str]]:
    return [(len(blob), hashlib.sha256(blob).hexdigest())] * ranks


def test_a_200_mb_argument_arrives_intact_on_every_rank_of_a_spark_job(spark_local, blob):
    assert HorovodRunner(np=2).run(digests, blob=blob) == expected(blob, 2)


def test_a_200_mb_argument_arrives_intact_on_every_local_rank(blob):
    assert HorovodRunner(np=-2).run(digests, blob=blob) == expected(blob, 2)
