"""A shard's columns as NumPy arrays, read from the memory-mapped Arrow file: what each Arrow type becomes.

- numbers, booleans, dates, timestamps and durations: NumPy arrays of their type, read in place (no copy)
  where Arrow's and NumPy's layouts agree (numbers without nulls, timestamps, durations). A column's dtype is
  chosen once for its whole shard, from the shard's nulls (each record batch's null count, in its metadata):
  integers of a shard with a null anywhere are float64 with NaN, booleans objects with ``None``, in every
  batch, also those without a null (:func:`with_nulls_dtype`); floats, dates and timestamps keep their dtype
  (NaN, NaT);
- strings and binary (and decimals): object arrays of ``str``, ``bytes`` (``Decimal``);
- arrays of numbers or booleans, and Spark ML vectors (dense and sparse, Spark's struct encoding of
  ``VectorUDT``): 2-D arrays, vectors as float64; rows of different lengths (or null) as an object array of
  1-D arrays (``None`` for null);
- anything else (maps, other structs, nested arrays, times of day, intervals of months): :class:`TypeError`,
  naming the column and its type. :func:`..driver.launch.spark.dataframe_plan.unsupported_type` is the
  driver's side of the same rule, on Spark's types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

if TYPE_CHECKING:
    from numpy.typing import NDArray

_VECTOR_FIELDS = {
    "type": pa.int8(),
    "size": pa.int32(),
    "indices": pa.list_(pa.int32()),
    "values": pa.list_(pa.float64()),
}
_DENSE, _SPARSE = 1, 0  # VectorUDT's "type" field


def is_vector(data_type: pa.DataType) -> bool:
    """Whether ``data_type`` is Spark ML's ``VectorUDT`` as it travels in Arrow (its sqlType, a struct)."""
    if not pat.is_struct(data_type) or data_type.num_fields != len(_VECTOR_FIELDS):
        return False
    fields = {data_type.field(i).name: data_type.field(i).type for i in range(data_type.num_fields)}
    return all(name in fields and _same_list(fields[name], t) for name, t in _VECTOR_FIELDS.items())


def _same_list(got: pa.DataType, want: pa.DataType) -> bool:
    if pat.is_list(want):
        return bool((pat.is_list(got) or pat.is_large_list(got)) and got.value_type == want.value_type)
    return bool(got == want)


def _numeric(data_type: pa.DataType) -> bool:
    return bool(pat.is_integer(data_type) or pat.is_floating(data_type) or pat.is_boolean(data_type))


def _is_list(data_type: pa.DataType) -> bool:
    return bool(pat.is_list(data_type) or pat.is_large_list(data_type) or pat.is_fixed_size_list(data_type))


def _scalar(data_type: pa.DataType) -> bool:
    return bool(
        _numeric(data_type)
        or pat.is_decimal(data_type)
        or pat.is_string(data_type)
        or pat.is_large_string(data_type)
        or pat.is_binary(data_type)
        or pat.is_large_binary(data_type)
        or pat.is_fixed_size_binary(data_type)
        or pat.is_date(data_type)
        or pat.is_timestamp(data_type)
        or pat.is_duration(data_type)
        or pat.is_null(data_type)
    )


def column_kind(name: str, data_type: pa.DataType) -> str:
    """``"scalar"``, ``"list"`` or ``"vector"``; TypeError for a type the ranks cannot read."""
    if pat.is_dictionary(data_type):
        data_type = data_type.value_type
    if _scalar(data_type):
        return "scalar"
    if _is_list(data_type) and _numeric(data_type.value_type):
        return "list"
    if is_vector(data_type):
        return "vector"
    raise TypeError(
        f"column {name!r} is of Arrow type {data_type}, which dataframe_shard() cannot give as a NumPy array; "
        "leave it out (columns=[...]), or convert it in Spark before the run"
    )


def _differ(lengths: NDArray[Any], valid: NDArray[Any] | None) -> bool:
    """Whether these rows (their ``lengths``, ``valid`` where some are null) are not 2-D: none, a null, or two
    lengths."""
    return valid is not None or not len(lengths) or not bool((lengths == lengths[0]).all())


def _rows_2d(
    values: NDArray[Any], offsets: NDArray[Any], valid: NDArray[Any] | None, ragged: bool | None
) -> NDArray[Any]:
    """Rows ``values[offsets[i]:offsets[i+1]]`` as a 2-D array when all have one length, else 1-D objects
    (``ragged``: whether the whole shard's rows differ, which decides for every batch; None: these rows')."""
    lengths = np.diff(offsets)
    if ragged is None:
        ragged = _differ(lengths, valid)
    if not ragged and len(lengths):
        start = offsets[0]
        return values[start : start + lengths.sum()].reshape(len(lengths), int(lengths[0]))
    rows = np.empty(len(lengths), dtype=object)
    for i in range(len(lengths)):
        rows[i] = values[offsets[i] : offsets[i + 1]] if valid is None or valid[i] else None
    return rows


def _list_values(array: pa.Array) -> tuple[NDArray[Any], NDArray[Any]]:
    """The flat values and the offsets (into them) of a list array."""
    if pat.is_fixed_size_list(array.type):
        flat = array.flatten()  # (the slice's values only)
        size = array.type.list_size
        return flat.to_numpy(zero_copy_only=False), np.arange(len(array) + 1) * size
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return values, offsets


def _valid(array: pa.Array) -> NDArray[Any] | None:
    return None if not array.null_count else array.is_valid().to_numpy(zero_copy_only=False)


def _vector_lengths(array: pa.StructArray) -> NDArray[Any]:
    """Each Spark ML vector's size (a dense one's values, a sparse one's ``size``)."""
    dense = array.field("type").to_numpy(zero_copy_only=False) == _DENSE
    _, value_offsets = _list_values(array.field("values"))
    sizes = array.field("size").fill_null(0).to_numpy(zero_copy_only=False)
    lengths: NDArray[Any] = np.where(dense, np.diff(value_offsets), sizes)
    return lengths


def row_length(chunks: list[pa.Array], kind: str) -> int | None:
    """The one length of every row of an array or vector column over the whole shard (its record batches
    ``chunks``), or None where they are not all of one length or one is null: then every batch gives 1-D objects,
    else 2-D (never one, then the other)."""
    if any(chunk.null_count for chunk in chunks):
        return None
    lengths: set[int] = set()
    for chunk in chunks:
        if isinstance(chunk, pa.DictionaryArray):
            chunk = chunk.dictionary_decode()
        if kind == "vector":
            found = _vector_lengths(chunk)
        elif pat.is_fixed_size_list(chunk.type):
            found = np.array([chunk.type.list_size]) if len(chunk) else np.array([], dtype=np.int64)
        else:
            found = np.diff(chunk.offsets.to_numpy())
        lengths.update(np.unique(found).tolist())
        if len(lengths) > 1:
            return None
    return int(next(iter(lengths), 0))


def _vectors(array: pa.StructArray, ragged: bool | None = None) -> NDArray[Any]:
    """Spark ML vectors as float64 rows: 2-D when all have one size, else 1-D objects (``None`` for null);
    ``ragged`` as :func:`_rows_2d`'s."""
    kinds = array.field("type").to_numpy(zero_copy_only=False)
    values, value_offsets = _list_values(array.field("values"))
    indices, index_offsets = _list_values(array.field("indices"))
    dense = kinds == _DENSE
    lengths = _vector_lengths(array)
    valid = _valid(array)
    n = len(array)
    if ragged is None:
        ragged = _differ(lengths, valid)
    if not ragged and n:
        out = np.zeros((n, int(lengths[0])), dtype=np.float64)
        rows = np.flatnonzero(dense)
        if rows.size:  # each dense row's values, in place
            starts = value_offsets[rows]
            out[rows] = values[starts[:, None] + np.arange(out.shape[1])]
        rows = np.flatnonzero(~dense)
        if rows.size:  # each sparse row's values at its indices
            counts = np.diff(index_offsets)[rows]
            row_of = np.repeat(rows, counts)
            taken = np.concatenate([np.arange(index_offsets[r], index_offsets[r + 1]) for r in rows])
            out[row_of, indices[taken]] = values[value_offsets[row_of] + (taken - index_offsets[row_of])]
        return out
    result = np.empty(n, dtype=object)
    for i in range(n):
        if valid is not None and not valid[i]:
            result[i] = None
        elif dense[i]:
            result[i] = values[value_offsets[i] : value_offsets[i + 1]].astype(np.float64)
        else:
            vector = np.zeros(int(lengths[i]), dtype=np.float64)
            vector[indices[index_offsets[i] : index_offsets[i + 1]]] = values[value_offsets[i] : value_offsets[i + 1]]
            result[i] = vector
    return result


def with_nulls_dtype(data_type: pa.DataType) -> np.dtype[Any] | None:
    """The NumPy dtype of every batch of a scalar column of ``data_type`` that has a null anywhere in its shard,
    where it differs from the batches without one: integers as float64 (NaN for null), booleans as objects
    (``None`` for null); None for the other types (their dtype is the same with nulls: NaN, NaT, ``None``)."""
    if pat.is_dictionary(data_type):
        data_type = data_type.value_type
    if pat.is_integer(data_type):
        return np.dtype(np.float64)
    if pat.is_boolean(data_type):
        return np.dtype(object)
    return None


def shard_dtype(chunks: list[pa.Array], kind: str) -> np.dtype[Any] | None:
    """The dtype every batch of a column of the shard (its record batches ``chunks``) gives, where a null changes
    it (:func:`with_nulls_dtype`): a scalar column's with a null anywhere in the shard, an array column's
    elements' with a null element anywhere in it (a null row is ``None``, whatever its elements); None
    otherwise. From the batches' null counts (metadata: nothing is read)."""
    if not chunks or kind == "vector":  # (a vector's values are never null: VectorUDT's doubles)
        return None
    if kind == "scalar":
        return with_nulls_dtype(chunks[0].type) if any(chunk.null_count for chunk in chunks) else None
    values = [chunk.values for chunk in chunks]  # (the elements of every row, null rows' too)
    return with_nulls_dtype(values[0].type) if any(chunk.null_count for chunk in values) else None


def to_numpy(
    array: pa.Array, kind: str, dtype: np.dtype[Any] | None = None, ragged: bool | None = None
) -> NDArray[Any]:
    """One column's rows (an Arrow array of :func:`column_kind` ``kind``) as NumPy; a scalar column, or an array
    column's elements, as ``dtype`` when given (:func:`shard_dtype`: the same in a batch without a null as in one
    with); an array or vector column 2-D or objects as ``ragged`` says (:func:`row_length`: the same in
    every batch)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array, pa.DictionaryArray):
        array = array.dictionary_decode()
    if kind == "scalar":
        values: NDArray[Any] = array.to_numpy(zero_copy_only=False)
        return values if dtype is None else values.astype(dtype, copy=False)
    if kind == "vector":
        return _vectors(array, ragged)
    flat, offsets = _list_values(array)
    return _rows_2d(flat if dtype is None else flat.astype(dtype, copy=False), offsets, _valid(array), ragged)
