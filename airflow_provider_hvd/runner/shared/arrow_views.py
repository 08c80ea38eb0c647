"""Arrow arrays as NumPy arrays in place (no copy), where their layouts agree: the rank's reader and the agent's
shard writer both read columns so.

Not with Arrow's ``Array.to_numpy``: its first conversion in a process imports pandas (measured: 0.26 s and
45 MB), which a rank would pay before its first batch and an agent while its shard streams in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.types as pat

if TYPE_CHECKING:
    import pyarrow as pa
    from numpy.typing import NDArray


def fixed_width_dtype(data_type: pa.DataType) -> np.dtype[Any] | None:
    """The NumPy dtype whose layout is Arrow's for ``data_type`` (numbers, timestamps, durations), else None."""
    if pat.is_integer(data_type):
        return np.dtype(f"{'i' if pat.is_signed_integer(data_type) else 'u'}{data_type.bit_width // 8}")
    if pat.is_floating(data_type):
        return np.dtype(f"f{data_type.bit_width // 8}")
    if pat.is_timestamp(data_type):
        return np.dtype(f"datetime64[{data_type.unit}]")  # (a time zone's values are UTC, as Arrow's to_numpy)
    if pat.is_duration(data_type):
        return np.dtype(f"timedelta64[{data_type.unit}]")
    return None


def fixed_width_view(array: pa.Array) -> NDArray[Any] | None:
    """``array``'s values in place (a read-only view of its buffer, as Arrow's buffers are immutable), where its
    layout is NumPy's: numbers without nulls, timestamps, durations; None for the others."""
    dtype = fixed_width_dtype(array.type)
    if dtype is None or array.null_count:
        return None
    buffer = array.buffers()[1]
    view: NDArray[Any] = (
        np.empty(0, dtype=dtype)
        if buffer is None
        else np.frombuffer(buffer, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    )
    view.flags.writeable = False
    return view
