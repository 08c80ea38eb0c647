"""This rank's shard of the run's DataFrame: :func:`dataframe_shard`, and its batches as NumPy or torch.

The agent wrote the shard to the executor's local disk before the rank started (:mod:`..agent.shard_writer`)
and said where in the rank's environment (:data:`..shared.shards.SHARD_ENV`). The file is memory-mapped:
each iteration reads it again, from the page cache, and asks Spark for nothing. Numeric columns without
nulls are read in place (the arrays are read-only views of the file); see :mod:`.arrow_columns` for the types
(each column's dtype is the same in every batch: chosen once for the shard).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..shared.arrow_views import fixed_width_view
from ..shared.shards import ShardInfo
from .arrow_columns import column_kind, row_length, shard_dtype, to_numpy
from .arrow_gather import Layout, MappedFile, UniformRows

if TYPE_CHECKING:
    import torch
    from numpy.typing import NDArray

_NO_SHARD = (
    "dataframe_shard() works in the ranks of a run on a DataFrame (TorchDistributor.train_on_dataframe, "
    "HorovodRunner.run_on_dataframe, or dataframe= on the operators); this process's run has no DataFrame"
)


class _Column:
    """One column over the shard's record batches: slices of consecutive rows, or rows gathered by index."""

    def __init__(self, name: str, chunks: list[pa.Array], file: MappedFile, kind: str) -> None:
        self.name = name
        self.kind = kind
        self.chunked = pa.chunked_array(chunks, type=chunks[0].type) if chunks else None
        # one dtype for the whole shard, from its nulls (the batches' null counts: metadata, nothing is read): a
        # scalar's, or an array's elements'
        self.dtype = shard_dtype(chunks, kind)
        # 2-D or objects for the whole shard, from its rows' lengths (the offsets only: no values are read)
        length = row_length(chunks, kind) if kind != "scalar" and chunks else None
        self.ragged = None if kind == "scalar" or not chunks else length is None
        views = [fixed_width_view(chunk) for chunk in chunks] if kind == "scalar" else []
        fixed = [view for view in views if view is not None]
        self.views: list[NDArray[Any]] | None = fixed if fixed and len(fixed) == len(views) else None
        self.file = file
        self.in_place: NDArray[Any] | None = None  # the whole file as this column's dtype (for gathers in place)
        self.starts: NDArray[np.int64] | None = None  # each chunk's first element in ``in_place``
        if self.views:
            dtype = self.views[0].dtype
            addresses = np.array([v.__array_interface__["data"][0] for v in self.views], dtype=np.int64)
            addresses -= file.address
            if not (addresses % dtype.itemsize).any():
                self.starts = addresses // dtype.itemsize
                self.in_place = file.words(dtype.itemsize).view(dtype)
        # the other columns' gathers read the rows' own buffers in the file (.arrow_gather): a 2-D column's its
        # elements at once, the others' an Arrow array of the column's type
        self.uniform = UniformRows.of(chunks, kind, length, file) if length and self.dtype is None else None
        self.layout = Layout.of(chunks, file) if chunks and self.starts is None and self.uniform is None else None

    def rows(self, pieces: list[tuple[int, int, int]]) -> NDArray[Any]:
        """Consecutive rows: ``pieces`` are (chunk, start, stop) within chunks."""
        if self.views is not None:
            if len(pieces) == 1:
                chunk, start, stop = pieces[0]
                return self.views[chunk][start:stop]
            return np.concatenate([self.views[chunk][start:stop] for chunk, start, stop in pieces])
        assert self.chunked is not None
        arrays = [self.chunked.chunk(chunk).slice(start, stop - start) for chunk, start, stop in pieces]
        return to_numpy(arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays), self.kind, self.dtype, self.ragged)

    def gather(self, rows: NDArray[np.int64], chunk_of: NDArray[np.int64], within: NDArray[np.int64]) -> NDArray[Any]:
        """The rows at shard indices ``rows`` (in chunk ``chunk_of``, at ``within``), in that order: only what
        they hold is read, whatever the shard's size."""
        if self.in_place is not None and self.starts is not None:
            gathered: NDArray[Any] = self.in_place[self.starts[chunk_of] + within]
            return gathered
        if self.uniform is not None:
            return self.uniform.gather(chunk_of, within)
        if self.layout is not None:
            array = self.layout.gather(self.file, chunk_of, within)
        else:  # (buffers outside the file: Arrow's take, which copies the whole column)
            assert self.chunked is not None
            array = self.chunked.take(pa.array(rows))
        return to_numpy(array, self.kind, self.dtype, self.ragged)


class DataFrameShard:
    """This rank's rows of the run's DataFrame, read from a memory-mapped Arrow file on the executor's disk.

    ``num_rows`` rows (they differ by at most one between ranks), ``schema`` their Arrow schema; ``index`` is
    the shard's index among ``num_shards``, ``total_rows`` the DataFrame's rows and ``min_rows`` the smallest
    shard's (floor(total_rows / num_shards)).
    """

    def __init__(self, info: ShardInfo) -> None:
        self.info = info
        self.index = info.index
        self.num_shards = info.shards
        self.total_rows = info.total_rows
        self.min_rows = info.min_rows
        self._file = pa.memory_map(info.path).read_buffer()  # the whole file, mapped: nothing is read yet
        self._mapped = MappedFile(self._file)
        reader = pa.ipc.open_stream(self._file)
        self.schema: pa.Schema = reader.schema
        self._batches = list(reader)  # (their buffers are slices of the mapped file)
        counts = [batch.num_rows for batch in self._batches]
        self.num_rows = sum(counts)
        if self.num_rows != info.rows:
            raise RuntimeError(f"the shard file {info.path} holds {self.num_rows} rows, not its {info.rows}")
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._columns: dict[str, _Column] = {}

    def __repr__(self) -> str:
        return f"DataFrameShard(index={self.index}, num_shards={self.num_shards}, num_rows={self.num_rows})"

    def _column(self, name: str) -> _Column:
        column = self._columns.get(name)
        if column is None:
            field = self.schema.field(name)
            kind = column_kind(name, field.type)
            position = self.schema.get_field_index(name)
            column = _Column(name, [b.column(position) for b in self._batches], self._mapped, kind)
            self._columns[name] = column
        return column

    def _chosen(self, columns: Sequence[str] | None) -> list[_Column]:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, not the string {columns!r}")
        names = list(self.schema.names if columns is None else columns)
        missing = [name for name in names if name not in self.schema.names]
        if missing:
            raise KeyError(f"the shard has no column {missing[0]!r}; its columns: {', '.join(self.schema.names)}")
        return [self._column(name) for name in names]  # (a type it cannot give fails here, before any batch)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        """How many batches :meth:`iter_batches` yields: with ``drop_last``, the same number on every rank."""
        _check_batch_size(batch_size)
        return self.min_rows // batch_size if drop_last else math.ceil(self.num_rows / batch_size)

    def iter_batches(
        self,
        batch_size: int,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> Iterator[dict[str, NDArray[Any]]]:
        """The shard's rows in batches of ``batch_size``: dicts of column name → NumPy array.

        ``columns``: those to read (default: all). ``shuffle``: in a random order, a new one each iteration;
        ``seed`` (e.g. the epoch) makes it repeatable (mixed with the shard's index: ranks get different
        orders). ``drop_last``: only full batches, and as many on every rank (floor(min_rows / batch_size)),
        so that collectives stay in step; without it the last batch may be short and ranks may yield one
        batch more than others.
        """
        batches = self.num_batches(batch_size, drop_last)
        chosen = self._chosen(columns)
        used = min(self.num_rows, batches * batch_size)
        if not shuffle:
            for start in range(0, used, batch_size):
                pieces = self._pieces(start, min(start + batch_size, used))
                yield {column.name: column.rows(pieces) for column in chosen}
            return
        order = self._permutation(seed)
        for start in range(0, used, batch_size):
            yield self._take(order[start : start + batch_size], chosen)

    def take(self, rows: Sequence[int] | NDArray[Any], columns: Sequence[str] | None = None) -> dict[str, NDArray[Any]]:
        """The rows at these indices of the shard (0 ... num_rows - 1), in that order: dicts of column name →
        NumPy array, as :meth:`iter_batches` yields them (e.g. for a map-style torch ``Dataset``)."""
        indices = np.asarray(rows, dtype=np.int64)
        if indices.ndim != 1:
            raise ValueError(f"take() takes a 1-D sequence of row indices, not an array of shape {indices.shape}")
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_rows):
            raise IndexError(f"take(): row indices must be in 0 ... {self.num_rows - 1}, the shard's rows")
        return self._take(indices, self._chosen(columns))

    def _take(self, rows: NDArray[Any], chosen: list[_Column]) -> dict[str, NDArray[Any]]:
        rows = rows.astype(np.int64, copy=False)
        chunk_of = np.searchsorted(self._starts, rows, side="right") - 1
        within = rows - self._starts[chunk_of]
        return {column.name: column.gather(rows, chunk_of, within) for column in chosen}

    def iter_torch_batches(
        self,
        batch_size: int,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`iter_batches` as torch tensors (on ``device`` when given). A column torch cannot hold
        (strings, timestamps, rows of different lengths) raises TypeError, naming it."""
        for batch in self.iter_batches(batch_size, columns, shuffle, seed, drop_last):
            yield {name: to_tensor(name, values, device) for name, values in batch.items()}

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Rows ``[start, stop)`` as (chunk, start, stop) within the record batches."""
        pieces = []
        chunk = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            chunk_stop = int(self._starts[chunk + 1])
            end = min(stop, chunk_stop)
            base = int(self._starts[chunk])
            pieces.append((chunk, start - base, end - base))
            start = end
            chunk += 1
        return pieces

    def _permutation(self, seed: int | None) -> NDArray[Any]:
        rng = np.random.default_rng(None if seed is None else [seed, self.index])
        order = np.arange(self.num_rows, dtype=np.int32 if self.num_rows < 2**31 else np.int64)
        rng.shuffle(order)
        return order


def to_tensor(name: str, values: NDArray[Any], device: Any = None) -> torch.Tensor:
    """A column's batch as a tensor; TypeError naming the column for what torch cannot hold."""
    import torch

    if values.dtype.kind not in "biuf":
        what = {"O": "objects (strings, bytes, decimals, or rows of different lengths)", "M": "timestamps"}.get(
            values.dtype.kind, f"{values.dtype}"
        )
        raise TypeError(
            f"column {name!r} holds {what}, which torch tensors cannot: leave it out (columns=[...]) or read it "
            "with iter_batches()"
        )
    tensor = torch.from_numpy(values if values.flags.writeable else values.copy())
    return tensor if device is None else tensor.to(device)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")


_opened: DataFrameShard | None = None


def dataframe_shard() -> DataFrameShard:
    """This rank's shard of the DataFrame its run was given (opened once per process).

    ``for batch in dataframe_shard().iter_batches(256, shuffle=True, seed=epoch, drop_last=True): ...``
    """
    global _opened
    info = ShardInfo.from_env()
    if info is None:
        raise RuntimeError(_NO_SHARD)
    if _opened is None or _opened.info != info:
        _opened = DataFrameShard(info)
    return _opened
