"""Rows gathered by index across a shard's record batches, read from their buffers in the memory-mapped file.

A shuffled batch must cost what an ordered one costs, whatever the shard's size. Arrow's ``ChunkedArray.take``
does not: for strings, lists and structs it concatenates every chunk first, a copy of the whole column per
batch (measured at 256 MiB: 13 to 29 ms a batch, and the column's size in memory; docs/benchmarks.md). Here each
column's chunks are described once (:class:`Layout`: where each chunk's buffers start in the file), and a gather
reads only what the rows asked for hold, with NumPy index arithmetic over the file's bytes: validity bits,
fixed-width values, offsets and the bytes or elements they span, recursively for lists and structs. It makes an
Arrow array of the column's own type, which the reader turns into NumPy as it does an ordered batch's rows
(:mod:`.arrow_columns`): the same dtypes either way.

A column whose buffers are not all in the file (none written by the shard writer; an Arrow reader may copy a
misaligned one) or of a layout not handled here (dictionaries) has no layout: its reader falls back to Arrow's
``take``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from ..shared.arrow_views import fixed_width_dtype, fixed_width_view

if TYPE_CHECKING:
    from numpy.typing import NDArray

_NONE = -1  # a chunk without that buffer (no validity bitmap: no null)
_LOOP_BYTES = 64  # strings and binary longer than this, on average, are copied a row at a time (no byte index)


class MappedFile:
    """The shard's file, mapped: its bytes, and its words of each width, as NumPy arrays (no copy)."""

    def __init__(self, file: pa.Buffer) -> None:
        self.address = file.address
        self.size = file.size
        self.bytes: NDArray[np.uint8] = np.frombuffer(file, dtype=np.uint8)
        self._words = {1: self.bytes}
        self._file = file

    def words(self, width: int) -> NDArray[Any]:
        """The file as unsigned ints of ``width`` bytes (1, 2, 4 or 8)."""
        if width not in self._words:
            self._words[width] = np.frombuffer(self._file, dtype=f"<u{width}", count=self.size // width)
        return self._words[width]

    def holds(self, buffer: pa.Buffer | None) -> bool:
        """Whether ``buffer`` lies within the file (an empty one may lie anywhere: nothing of it is read)."""
        if buffer is None or buffer.size == 0:
            return True
        return bool(self.address <= buffer.address and buffer.address + buffer.size <= self.address + self.size)

    def at(self, buffer: pa.Buffer | None) -> int:
        return _NONE if buffer is None or buffer.size == 0 else int(buffer.address - self.address)


def _bits(file: MappedFile, starts: NDArray[np.int64], positions: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Bit ``positions[i]`` of the bitmap at ``starts[i]`` (each row's own chunk's)."""
    found: NDArray[np.bool_] = ((file.bytes[starts + (positions >> 3)] >> (positions & 7)) & 1).astype(bool)
    return found


def _spans(starts: NDArray[np.int64], offsets: NDArray[np.int64]) -> NDArray[np.int64]:
    """``starts[i] ... starts[i] + offsets[i + 1] - offsets[i] - 1`` for each ``i``, one after the other."""
    spans: NDArray[np.int64] = np.repeat(starts - offsets[:-1], np.diff(offsets)) + np.arange(offsets[-1])
    return spans


def _form(kind: pa.DataType) -> str | None:
    """How a gather reads a column of this type: its buffers' layout; None for a layout not handled here."""
    if pat.is_null(kind):
        return "null"
    if pat.is_boolean(kind):
        return "bits"
    if pat.is_string(kind) or pat.is_binary(kind) or pat.is_large_string(kind) or pat.is_large_binary(kind):
        return "bytes"
    if pat.is_list(kind) or pat.is_large_list(kind):
        return "list"
    if pat.is_fixed_size_list(kind):
        return "fixed_list"
    if pat.is_struct(kind):
        return "struct"
    if pat.is_dictionary(kind):
        return None
    if pat.is_primitive(kind) or pat.is_decimal(kind) or pat.is_fixed_size_binary(kind):
        return "fixed"
    return None


@dataclass(frozen=True)
class Layout:
    """Where each chunk's buffers of one column (or one child of it) start in the file, and each chunk's offset
    (in rows): made once per column, then used by every :meth:`gather`."""

    type: pa.DataType
    form: str  # (_form)
    width: int  # the values' bytes (fixed), the offsets' (bytes, list): 4, or 8 for the large types
    offset: NDArray[np.int64] | None  # each chunk's array offset (None: all 0, as the shard writer's are)
    validity: NDArray[np.int64] | None  # each chunk's validity bitmap, in bytes (_NONE: no null; None: no null at all)
    main: NDArray[np.int64]  # each chunk's values or offsets: in words of ``width`` where aligned, else bytes
    aligned: bool  # ``main`` counts words of ``width``
    data: NDArray[np.int64]  # each chunk's bytes, of strings and binary (else _NONE)
    children: tuple[Layout, ...]

    @classmethod
    def of(cls, chunks: list[pa.Array], file: MappedFile) -> Layout | None:
        """The layout of a column of ``chunks`` (the record batches' arrays, of one type), or None."""
        kind = chunks[0].type
        form = _form(kind)
        if form is None or not all(
            file.holds(buffer) for chunk in chunks if len(chunk) for buffer in chunk.buffers()[:3]
        ):
            return None
        children: list[Layout | None] = []
        if form == "struct":
            children = [cls.of([chunk.field(i) for chunk in chunks], file) for i in range(kind.num_fields)]
        elif form in ("list", "fixed_list"):
            children = [cls.of([chunk.values for chunk in chunks], file)]
        if any(child is None for child in children):
            return None
        own = [[*chunk.buffers(), None, None, None][:3] for chunk in chunks]  # validity, values or offsets, bytes
        if form in ("bytes", "list"):
            width = 8 if pat.is_large_string(kind) or pat.is_large_binary(kind) or pat.is_large_list(kind) else 4
        else:
            width = kind.byte_width if form == "fixed" else 1
        main = np.array([file.at(buffers[1]) for buffers in own], dtype=np.int64)
        aligned = width in (1, 2, 4, 8) and not (main[main != _NONE] % width).any()  # (Arrow's IPC aligns them)
        validity = np.array([file.at(own[i][0]) if chunk.null_count else _NONE for i, chunk in enumerate(chunks)])
        offsets = np.array([chunk.offset for chunk in chunks], dtype=np.int64)
        return cls(
            kind,
            form,
            width,
            offsets if offsets.any() else None,
            validity if (validity != _NONE).any() else None,
            np.where(main == _NONE, _NONE, main // width) if aligned else main,
            aligned,
            np.array([file.at(buffers[2]) for buffers in own], dtype=np.int64),
            tuple(child for child in children if child is not None),
        )

    def gather(self, file: MappedFile, chunk: NDArray[np.int64], index: NDArray[np.int64]) -> pa.Array:
        """The rows at ``index`` of chunks ``chunk`` (row ``i`` is ``index[i]`` of ``chunk[i]``), in that order,
        as one Arrow array of the column's type."""
        kind, form, n = self.type, self.form, len(index)
        if form == "null":
            return pa.nulls(n)
        position = index if self.offset is None else index + self.offset[chunk]  # (within the chunk's buffers)
        validity, nulls = self._validity(file, chunk, position)
        if form == "bits":
            values = np.packbits(_bits(file, self.main[chunk], position), bitorder="little")
            return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(values)], nulls)
        if form in ("bytes", "list"):
            words = file.words(self.width)
            first = self.main[chunk] + position
            starts = words[first].astype(np.int64)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(words[first + 1] - starts, out=offsets[1:])
            shown = pa.py_buffer(offsets if self.width == 8 else offsets.astype(np.int32))
            if form == "bytes":
                return pa.Array.from_buffers(
                    kind, n, [validity, shown, self._bytes(file, chunk, starts, offsets)], nulls
                )
            child = self.children[0].gather(file, np.repeat(chunk, np.diff(offsets)), _spans(starts, offsets))
            return pa.Array.from_buffers(kind, n, [validity, shown], nulls, children=[child])
        if form == "fixed_list":
            size = kind.list_size
            inner = (position[:, None] * size + np.arange(size, dtype=np.int64)).ravel()
            child = self.children[0].gather(file, np.repeat(chunk, size), inner)
            return pa.Array.from_buffers(kind, n, [validity], nulls, children=[child])
        if form == "struct":
            fields = [child.gather(file, chunk, index) for child in self.children]  # (fields: offset applied)
            return pa.Array.from_buffers(kind, n, [validity], nulls, children=fields)
        if self.aligned:
            values = file.words(self.width)[self.main[chunk] + position]
        else:  # decimals, fixed-size binary: byte by byte
            start = self.main[chunk] + position * self.width
            values = file.bytes[start[:, None] + np.arange(self.width, dtype=np.int64)]
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(values)], nulls)

    def _validity(
        self, file: MappedFile, chunk: NDArray[np.int64], position: NDArray[np.int64]
    ) -> tuple[pa.Buffer | None, int]:
        """The gathered rows' validity bitmap (None: no null) and their null count."""
        if self.validity is None:
            return None, 0
        bitmap = self.validity[chunk]
        has = bitmap != _NONE
        valid = np.ones(len(position), dtype=bool)
        valid[has] = _bits(file, bitmap[has], position[has])
        nulls = len(valid) - int(valid.sum())
        return (pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None), nulls

    def _bytes(
        self, file: MappedFile, chunk: NDArray[np.int64], starts: NDArray[np.int64], offsets: NDArray[np.int64]
    ) -> pa.Buffer:
        """The bytes of the gathered strings or binary values (``offsets``: theirs), one after the other."""
        begin = self.data[chunk] + starts
        if offsets[-1] <= _LOOP_BYTES * len(starts):
            return pa.py_buffer(file.bytes[_spans(begin, offsets)])
        view = memoryview(file.bytes.data)  # long values: a copy each, without an index of every byte
        ends = begin + np.diff(offsets)
        return pa.py_buffer(b"".join([view[b:e] for b, e in zip(begin.tolist(), ends.tolist(), strict=True)]))


@dataclass(frozen=True)
class UniformRows:
    """An array or vector column whose every row in the shard holds ``length`` numbers of one fixed width, none
    null, one after the other in the file (a 2-D column): a gather of rows is one NumPy gather of their elements,
    ``(rows, length)``, as an ordered batch's rows are a slice of them."""

    first: NDArray[np.int64]  # each chunk's first row's first element, in the file's words of the elements' dtype
    length: int
    elements: NDArray[Any]  # the file as the elements' dtype

    @classmethod
    def of(cls, chunks: list[pa.Array], kind: str, length: int, file: MappedFile) -> UniformRows | None:
        """For the chunks of a column of :func:`.arrow_columns.column_kind` ``kind`` (``list`` or ``vector``)
        whose rows all hold ``length`` elements (none null: :func:`.arrow_columns.row_length`); None
        where they do not lie so (sparse vectors, null or boolean elements, a buffer outside the file)."""
        if kind == "vector":
            types = [fixed_width_view(chunk.field("type")) for chunk in chunks]
            if not all(found is not None and (found == 1).all() for found in types):
                return None  # a sparse vector's values are not its row (1: dense, in VectorUDT's struct)
            chunks = [chunk.field("values") for chunk in chunks]
        values = [chunk.values for chunk in chunks]
        dtype = fixed_width_dtype(values[0].type)
        if dtype is None or dtype.kind not in "iuf" or any(value.null_count for value in values):
            return None
        first = []
        for chunk, value in zip(chunks, values, strict=True):
            if not len(chunk):
                first.append(0)
                continue
            buffer = value.buffers()[1]
            row0 = chunk.offset * length if pat.is_fixed_size_list(chunk.type) else chunk.offsets[0].as_py()
            at = file.at(buffer) + (value.offset + row0) * dtype.itemsize
            if not file.holds(buffer) or at % dtype.itemsize:
                return None
            first.append(at // dtype.itemsize)
        return cls(np.array(first, dtype=np.int64), length, file.words(dtype.itemsize).view(dtype))

    def gather(self, chunk: NDArray[np.int64], index: NDArray[np.int64]) -> NDArray[Any]:
        start = self.first[chunk] + index * self.length
        rows: NDArray[Any] = self.elements[start[:, None] + np.arange(self.length)]
        return rows
