"""Code shipped by value keeps its file's name and lines, so that the ranks' tracebacks and stacks show them.

cloudpickle 3.1.3 names every code object it pickles by value ``<dynamic-code>`` (for payloads that do not
depend on where a function was written): a rank's traceback then reads ``File "<dynamic-code>", line 209, in
train`` with no source line, and so do its stall stacks. :class:`JobPickler` is cloudpickle's pickler with one
reducer changed: a code object keeps its ``co_filename``, and carries its file's lines as the pickling process
reads them (``linecache``: a script, a DAG file, a helper module, a notebook cell that IPython registered
there). The lines of a file go once per payload (pickle keeps one copy of a list met twice); the rank puts them
in its own ``linecache``, where ``traceback`` finds them whether or not that host has the file.
"""

from __future__ import annotations

import linecache
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle


def _code_from(
    make: Callable[..., types.CodeType], args: tuple[Any, ...], file: str, lines: list[str]
) -> types.CodeType:
    """The code object cloudpickle's reducer described, named ``file`` again, and ``lines`` in ``linecache``."""
    if lines:  # mtime None: linecache keeps the entry (as IPython's cells) and never reads a file of that name instead
        linecache.cache[file] = (sum(map(len, lines)), None, lines, file)
    return make(*args).replace(co_filename=file)


class JobPickler(cloudpickle.Pickler):  # type: ignore[misc]  # (cloudpickle has no type information)
    """cloudpickle's pickler, whose code objects keep their file's name and carry its lines."""

    def __init__(self, file: Any) -> None:
        self._lines: dict[str, list[str]] = {}
        # before pickle's __init__, which reads it
        self.dispatch_table = ChainMap({types.CodeType: self._reduce_code}, cloudpickle.Pickler.dispatch_table)
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)

    def _reduce_code(self, code: types.CodeType) -> tuple[Any, ...]:
        make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
        file = code.co_filename
        if file not in self._lines:  # the same list for each code object of the file: pickled once
            self._lines[file] = list(linecache.getlines(file))
        return _code_from, (make, args, file, self._lines[file])


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, with :class:`JobPickler`."""
    import io

    with io.BytesIO() as file:
        JobPickler(file).dump(obj)
        return file.getvalue()
