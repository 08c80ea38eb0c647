"""A barrier task's shards, written to the executor's local disk as they stream in from Spark.

:func:`receive_shards` takes the task's iterator of Arrow record batches (``mapInArrow``'s) and writes each
rank's rows to an Arrow IPC stream file of its own (the format PySpark's loader reads), one batch at a time:
the task never holds more than the batch it is writing. It checks that the task got exactly its rows, in
order (the plan's row index, :data:`..shared.shards.ROW_COLUMN`, which it drops).

The files are in the task's local directories (``spark.local.dir``: Spark gives its Python workers their
executor's in ``SPARK_LOCAL_DIRS``; the temp dir elsewhere) and have no name there: each is opened unlinked
(``O_TMPFILE``), held open by this process, and read by its rank through ``/proc/<pid>/fd/<fd>``. The kernel
frees a file once the last process holding it has ended or closed it, so nothing outlives the run, whatever
ends it: :meth:`TaskShards.release` once its rank has ended (before its agent reports it: a driver that has every
rank's report knows their files gone), :meth:`TaskShards.close` at the task's end, or the task's process killed
(the ranks die with it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..shared.arrow_views import fixed_width_view
from ..shared.shards import ROW_COLUMN, FeedSpec, ShardInfo

if TYPE_CHECKING:
    import pyarrow as pa

LOCAL_DIRS_ENV = "SPARK_LOCAL_DIRS"  # set by Spark for its Python workers: the executor's local directories
_NOT_THE_COUNTED_ROWS = (
    "the DataFrame did not give the rows it had when it was counted (a source that changed, or a "
    "non-deterministic expression such as rand() without a seed): persist it first (df.localCheckpoint(), "
    "or write it to a table)"
)


def local_dirs() -> list[str]:
    """Where this task may write large files: Spark's local directories, or the temp dir outside Spark."""
    dirs = [d for d in os.environ.get(LOCAL_DIRS_ENV, "").split(",") if d]
    return dirs or [tempfile.gettempdir()]


def open_unlinked(directory: str) -> int:
    """A new file in ``directory`` that has no name (freed once closed by all), open for reading and writing."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:  # a file system without O_TMPFILE: a named file, unlinked at once
        fd, path = tempfile.mkstemp(prefix="hvd-shard-", suffix=".arrow", dir=directory)
        os.unlink(path)
        return fd


@dataclass(frozen=True)
class ShardFile:
    """One rank's shard: ``info`` is what its rank gets (:meth:`rank_env`), ``fd`` this process's hold on it."""

    info: ShardInfo
    fd: int
    schema: pa.Schema
    directory: str

    def rank_env(self) -> dict[str, str]:
        """The variables that tell the rank where its shard is (``dataframe_shard()`` reads them)."""
        return self.info.to_env()


class TaskShards:
    """The shards of one barrier task, one per rank of the task in order; :meth:`close` frees them."""

    def __init__(self, shards: list[ShardFile]) -> None:
        self.shards = shards
        self._fds = [shard.fd for shard in shards]  # (-1 once let go)

    def rank_env(self, process: int) -> dict[str, str]:
        """The environment of the task's ``process``-th rank (0 when the task runs one rank)."""
        return self.shards[process].rank_env()

    def release(self, process: int) -> None:
        """Let the ``process``-th rank's file go (its rank has ended: its space is freed now)."""
        fd, self._fds[process] = self._fds[process], -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Let the files go (their space is freed once their ranks have ended too)."""
        for process in range(len(self._fds)):
            self.release(process)

    def __enter__(self) -> TaskShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Writer:
    """The shards of a task, written one after the other as the task's rows come."""

    def __init__(self, feed: FeedSpec, task: int, dirs: list[str]) -> None:
        self.feed = feed
        self.task = task
        self.dirs = dirs
        self.bytes = 0  # written to the shards finished so far
        self.pending = list(feed.task_shards(task))  # shards not yet started
        self.done: list[ShardFile] = []
        self.next_row, self.task_stop = feed.task_range(task)
        self.shard: int | None = None
        self.stop = 0  # the current shard's end (a global row)
        self.fd = -1
        self.schema: pa.Schema | None = None
        self.stream: pa.ipc.RecordBatchStreamWriter | None = None
        self.sink: pa.NativeFile | None = None

    def _open(self, schema: pa.Schema) -> None:
        import pyarrow as pa

        self.shard = self.pending.pop(0)
        self.stop = self.feed.shard_range(self.shard)[1]
        directory = self.dirs[self.shard % len(self.dirs)]
        self.fd = open_unlinked(directory)
        self.sink = pa.OSFile(f"/proc/self/fd/{self.fd}", "wb")
        self.stream = pa.ipc.new_stream(self.sink, schema)

    def _finish(self) -> None:
        import pyarrow as pa

        assert self.stream is not None and self.sink is not None and self.shard is not None and self.schema
        self.stream.close()
        self.bytes += self.sink.tell()
        self.sink.close()
        start, stop = self.feed.shard_range(self.shard)
        info = ShardInfo(
            path=f"/proc/{os.getpid()}/fd/{self.fd}",
            rows=stop - start,
            index=self.shard,
            shards=self.feed.ranks,
            total_rows=self.feed.rows,
            min_rows=self.feed.min_rows,
        )
        directory = self.dirs[self.shard % len(self.dirs)]
        self.done.append(ShardFile(info, self.fd, pa.schema(self.schema), directory))
        self.stream = self.sink = self.shard = None
        self.fd = -1

    def _check(self, rows: pa.Array) -> None:
        import numpy as np

        got = fixed_width_view(rows)
        assert got is not None  # (the plan's row index: longs, never null)
        wrong = np.flatnonzero(got != np.arange(self.next_row, self.next_row + len(got)))
        if wrong.size:
            what = f"the DataFrame's row {int(got[wrong[0]])} where row {self.next_row + int(wrong[0])} was due"
        elif self.next_row + len(got) > self.task_stop:
            what = f"more than its {self.task_stop - self.feed.task_range(self.task)[0]} rows"
        else:
            return
        raise RuntimeError(f"Spark task {self.task} got {what}: {_NOT_THE_COUNTED_ROWS}.")

    def write(self, batch: pa.RecordBatch) -> None:
        self._check(batch.column(ROW_COLUMN))
        data = batch.drop_columns([ROW_COLUMN])
        if self.schema is None:
            self.schema = data.schema
        while data.num_rows:
            if self.stream is None:
                self._open(self.schema)
            assert self.stream is not None
            take = min(data.num_rows, self.stop - self.next_row)
            self.stream.write_batch(data.slice(0, take))
            self.next_row += take
            data = data.slice(take)
            if self.next_row == self.stop:
                self._finish()

    def written(self) -> tuple[int, int]:
        """The rows and bytes written to the task's shards so far."""
        current = self.sink.tell() if self.sink is not None else 0
        return self.next_row - self.feed.task_range(self.task)[0], self.bytes + current

    def close(self) -> None:
        if self.next_row != self.task_stop:
            start = self.feed.task_range(self.task)[0]
            raise RuntimeError(
                f"Spark task {self.task} got {self.next_row - start} of its {self.task_stop - start} rows: "
                f"{_NOT_THE_COUNTED_ROWS}."
            )

    def abandon(self) -> None:
        for fd in [self.fd, *(shard.fd for shard in self.done)]:
            if fd >= 0:
                os.close(fd)
        if self.sink is not None:
            self.sink.close()


def receive_shards(
    batches: Iterable[pa.RecordBatch],
    feed: FeedSpec,
    task: int,
    dirs: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TaskShards:
    """Write task ``task``'s rows from ``batches`` into one shard file per rank of the task, as they come.

    ``dirs``: where to write (default: :func:`local_dirs`; a task's shards take turns over them). ``progress``
    is told the rows and bytes written so far after each batch (:class:`.shard_report.ShardReport`). Raises
    RuntimeError when the task does not get exactly the rows the plan gave it (and keeps no file then).
    """
    writer = _Writer(feed, task, dirs or local_dirs())
    try:
        for batch in batches:
            writer.write(batch)
            if progress is not None:
                progress(*writer.written())
        writer.close()
    except BaseException as exc:
        writer.abandon()
        if isinstance(exc, OSError):
            raise OSError(
                exc.errno,
                f"could not write Spark task {task}'s shard to {writer.dirs} (spark.local.dir): {exc.strerror}",
            ) from exc
        raise
    return TaskShards(writer.done)
