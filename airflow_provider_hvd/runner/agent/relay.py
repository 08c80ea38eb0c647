"""A rank's output on its way to the driver: raw bytes split into lines and markers, then batched and bounded.

The rank's stdout and stderr are one pipe. ``\\n``, ``\\r\\n`` and ``\\r`` each end a line (a progress bar
redrawn with ``\\r`` is relayed as it goes). A :func:`log_to_driver` marker is recognised wherever it appears,
also in the middle of a line another thread was writing; the text before it goes out as a line of its own.
Lines are split as bytes and decoded whole, so a character is never cut; a line longer than the limit is
cut at a character boundary.
"""

from __future__ import annotations

import collections
import threading

from ..shared.messages import LogBatch, send
from ..shared.wire import FrameStream

MAX_LINE_BYTES = 64 << 10
OUTBOX_CAPACITY_BYTES = 32 << 20  # per rank; past it lines are dropped and counted
_BATCH_LINES = 2000
_MAX_SEQ_DIGITS = 20

Piece = str | int  # a line of text, or the sequence number of a log_to_driver message


def _cut_point(data: bytes | bytearray, limit: int) -> int:
    """The largest cut at or below ``limit`` that does not split a UTF-8 character."""
    cut = limit
    while cut > 0 and (data[cut] & 0xC0) == 0x80:  # a continuation byte: the character started before
        cut -= 1
    return cut or limit


class OutputSplitter:
    """Turns the bytes of a rank's output into lines and ``log_to_driver`` markers (``marker`` + seq + ``\\n``)."""

    def __init__(self, marker: bytes, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._marker = marker
        self._max = max_line_bytes
        self._buf = bytearray()
        self._skip_lf = False  # the last line ended with \r: a \n right after it belongs to that line
        self._cut_by_marker = False  # the last line was text a marker interrupted: its end may follow alone

    def feed(self, data: bytes) -> list[Piece]:
        self._buf += data
        pieces: list[Piece] = []
        while True:
            if not (self._skip_lf or self._cut_by_marker):
                self._take_plain_lines(pieces)
            if not self._next(pieces, final=False):
                return pieces

    def _take_plain_lines(self, pieces: list[Piece]) -> None:
        """Take at once the whole lines before the first ``\r`` or possible marker (a flood of plain lines:
        one split in C, where :meth:`_next`, a piece at a time, costs microseconds a line)."""
        buf = self._buf
        stop = len(buf)
        for special in (b"\r", self._marker[:1]):
            found = buf.find(special, 0, stop)
            if found >= 0:
                stop = found
        end = buf.rfind(b"\n", 0, stop)
        if end < 0:
            return
        if end > self._max:  # a line too long may be among them: only those before it (the rest goes by _next)
            start = 0
            for line in bytes(buf[:end]).split(b"\n"):
                if len(line) > self._max:
                    end = start - 1
                    break
                start += len(line) + 1
            if end < 0:
                return
        # (decoded whole: \n is never part of a UTF-8 character, and an invalid sequence is replaced alike)
        pieces.extend(buf[:end].decode("utf-8", "replace").split("\n"))
        del buf[: end + 1]

    def end(self) -> list[Piece]:
        """What is left once the output is closed (a last line without a newline)."""
        pieces: list[Piece] = []
        while self._next(pieces, final=True):
            pass
        if self._buf:
            pieces.append(self._buf.decode("utf-8", "replace"))
            self._buf.clear()
        return pieces

    def _emit(self, pieces: list[Piece], end: int, skip: int) -> None:
        if end > 0 or not (self._cut_by_marker or self._buf[:1] == b"\r"):  # no empty line for a bare \r
            pieces.append(self._buf[:end].decode("utf-8", "replace"))
        self._cut_by_marker = False
        del self._buf[: end + skip]

    def _next(self, pieces: list[Piece], final: bool) -> bool:
        """Take one piece off the buffer; False when it holds no complete piece."""
        buf = self._buf
        if self._skip_lf and buf:
            self._skip_lf = False
            if buf[0] == 0x0A:
                del buf[0]
        if not buf:
            return False
        newline, ret, mark = buf.find(b"\n"), buf.find(b"\r"), buf.find(self._marker)
        line_end = min((i for i in (newline, ret) if i >= 0), default=-1)
        if mark > 0 and (line_end < 0 or mark < line_end):  # text another writer left unfinished
            self._emit(pieces, mark, 0)
            self._cut_by_marker = True
            return True
        if mark == 0:
            seq_end = buf.find(b"\n", len(self._marker))
            if seq_end < 0 and len(buf) <= len(self._marker) + _MAX_SEQ_DIGITS and not final:
                return False  # the rest of the marker is on its way
            digits = bytes(buf[len(self._marker) : seq_end])
            if seq_end >= 0 and digits.isdigit() and len(digits) <= _MAX_SEQ_DIGITS:
                pieces.append(int(digits))
                del buf[: seq_end + 1]
                return True  # (a line the marker cut stays cut: its end may follow alone)
            # not a marker after all: plain text
        if 0 <= line_end <= self._max:
            self._skip_lf = buf[line_end] == 0x0D and line_end > 0
            self._emit(pieces, line_end, 1)
            return True
        if len(buf) > self._max:
            cut = _cut_point(buf, self._max)
            partial_marker = buf.rfind(self._marker[:1], max(1, cut - len(self._marker)), cut)
            self._emit(pieces, partial_marker if partial_marker > 0 else cut, 0)
            return True
        return False  # a partial line: held until it ends


def _wire_size(text: str) -> int:
    """About what ``text`` takes in a batch: its UTF-8 bytes, quotes and a comma."""
    return (len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))) + 4


class Outbox:
    """Lines on their way to the driver, bounded in bytes.

    The rank's pipe is always drained, so a slow driver never stalls training; past the bound, lines are
    dropped and counted, and the count travels with the next batch.
    """

    def __init__(self, stream: FrameStream, capacity_bytes: int | None = None) -> None:
        self._stream = stream
        self._capacity = capacity_bytes or OUTBOX_CAPACITY_BYTES
        self._cond = threading.Condition()
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._batches: collections.deque[tuple[LogBatch, int]] = collections.deque()
        self._queued_bytes = 0
        self._dropped = 0
        self.total_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="hvd-agent-outbox", daemon=True)
        self._thread.start()

    def put(self, text: str) -> None:
        self.put_lines([text])

    def put_lines(self, lines: list[str]) -> None:
        """Queue ``lines`` in order (past the bound, dropped and counted), under one lock for them all."""
        with self._cond:
            for text in lines:
                size = _wire_size(text)
                if self._queued_bytes + size > self._capacity:
                    self._dropped += 1
                    self.total_dropped += 1
                    continue
                self._pending.append(text)
                self._pending_bytes += size
                self._queued_bytes += size
                if len(self._pending) >= _BATCH_LINES:
                    self._seal()
            self._cond.notify()

    def _seal(self) -> None:
        self._batches.append((LogBatch(self._pending, self._dropped), self._pending_bytes))
        self._pending, self._pending_bytes, self._dropped = [], 0, 0

    def _pump(self) -> None:
        while True:
            with self._cond:
                while not (self._batches or self._pending or self._dropped or self._closed):
                    self._cond.wait()
                if self._pending or self._dropped:
                    self._seal()
                if not self._batches:
                    return  # closed and empty
                batch, size = self._batches.popleft()
            try:
                send(self._stream, batch)
            except OSError:
                return  # the driver is gone; the agent's watcher ends the rank
            with self._cond:
                self._queued_bytes -= size

    def close(self) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
