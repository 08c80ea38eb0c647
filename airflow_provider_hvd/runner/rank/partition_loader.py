"""PySpark's ``_get_spark_partition_data_loader``, on this rank's shard: the same batches, read by column.

PySpark's loader (``pyspark.ml.torch.data._SparkPartitionTorchDataset``) reads its partition's Arrow file row
by row through pandas, cycles over it until ``num_samples`` rows, and lets torch's ``default_collate`` batch
the rows: each batch is a list with one tensor per column, numbers as float64 (floating point columns) or
int64 (integer columns), arrays of numbers and Spark ML vectors as 2-D tensors (arrays keep their element
type, vectors are float64). This one yields the same batches, made a batch at a time from the memory-mapped
shard; ``num_workers > 1`` is allowed (PySpark's refuses it): each worker makes every ``num_workers``-th batch,
and torch's loader hands them out in order. Columns: PySpark's (float, double, int, bigint, smallint, arrays of
those, vectors), and also tinyint and boolean; strings come as lists of ``str``; other types raise ValueError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .dataframe import DataFrameShard, dataframe_shard

if TYPE_CHECKING:
    import torch
    from numpy.typing import NDArray


def _as_collated(name: str, values: NDArray[Any]) -> Any:
    """A column's batch as ``default_collate`` makes it of PySpark's rows."""
    import torch

    kind = values.dtype.kind
    if values.ndim == 1 and kind == "f":
        return torch.from_numpy(values.astype(np.float64))  # (Python floats, one per row)
    if values.ndim == 1 and kind in "iu":
        return torch.from_numpy(values.astype(np.int64))  # (Python ints)
    if values.ndim == 1 and kind == "b":
        return torch.from_numpy(values.copy())
    if values.ndim == 2 and kind in "biuf":
        return torch.from_numpy(values.copy())  # (rows of NumPy arrays, stacked)
    if values.ndim == 1 and kind == "O" and all(isinstance(v, str) for v in values):
        return list(values)
    raise ValueError(
        f"get_spark_partition_data_loader cannot load column {name!r} ({values.dtype}, {values.ndim}-D): "
        "use dataframe_shard().iter_batches() for it, or leave it out of the DataFrame"
    )


def _batches(shard: DataFrameShard, num_samples: int, batch_size: int, worker: int, workers: int) -> Any:
    names = shard.schema.names
    total = -(-num_samples // batch_size)
    for number in range(worker, total, workers):
        rows = np.arange(number * batch_size, min((number + 1) * batch_size, num_samples), dtype=np.int64)
        batch = shard.take(rows % shard.num_rows)  # cycling over the shard, as PySpark's does
        yield [_as_collated(name, batch[name]) for name in names]


def _dataset(num_samples: int, batch_size: int) -> torch.utils.data.IterableDataset[Any]:
    import torch.utils.data

    class ShardBatches(torch.utils.data.IterableDataset[Any]):
        """This rank's shard in PySpark's batches; each loader worker makes its share of them."""

        def __iter__(self) -> Any:
            info = torch.utils.data.get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            return _batches(dataframe_shard(), num_samples, batch_size, worker, workers)

    return ShardBatches()


def get_spark_partition_data_loader(
    num_samples: int, batch_size: int, num_workers: int = 1, prefetch_factor: int = 2
) -> torch.utils.data.DataLoader[Any]:
    """A torch DataLoader over this rank's shard, as PySpark's ``_get_spark_partition_data_loader`` gives.

    ``num_samples`` rows per epoch: the first ``num_samples`` of the shard, or the shard again from its start
    until there are that many; in batches of ``batch_size`` (the last one may be short), each a list with one
    tensor per column. ``num_workers`` processes make them (0: this process), ``prefetch_factor`` batches
    ahead each. Called inside the function a DataFrame run gives its ranks.
    """
    from torch.utils.data import DataLoader

    shard = dataframe_shard()  # (fails here, not in a worker, in a run without a DataFrame)
    first = shard.take([0])
    for name, values in first.items():  # (a column it cannot load fails here, not in a worker)
        _as_collated(name, values)
    dataset = _dataset(num_samples, batch_size)
    if num_workers > 0:
        return DataLoader(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=prefetch_factor)
    return DataLoader(dataset, batch_size=None, num_workers=0)
