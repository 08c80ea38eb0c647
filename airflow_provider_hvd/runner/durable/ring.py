"""The run's log lines on its host: numbered, bounded, kept for whoever attaches next.

Each entry is a batch of one rank's lines or one runner message, numbered by line. The oldest entries go once
the ring holds more than ``max_lines`` lines or ``max_chars`` characters; a client that resumes from a line no
longer kept is told how many it lost. ``acked`` is the last line any client said it relayed: a client attached
afresh resumes after it (no line twice, none skipped while the ring held it).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

MAX_LINES = 20_000
MAX_CHARS = 8 << 20

Entry = list[Any]  # ["rank", rank, [lines]] (["rank", rank, [lines], attempt] after the first) or ["log", ...]


def entry_lines(entry: Entry) -> int:
    return len(entry[2]) if entry[0] == "rank" else 1


def _chars(entry: Entry) -> int:
    return sum(map(len, entry[2])) if entry[0] == "rank" else len(entry[3])


class LineRing:
    def __init__(self, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> None:
        self.max_lines, self.max_chars = max_lines, max_chars
        self._entries: collections.deque[tuple[int, Entry, int]] = collections.deque()  # (first line, entry, chars)
        self._lines = self._chars = 0
        self.next = 0  # the number the next line gets
        self.acked = 0  # every line before this one was relayed by a client
        self.changed = threading.Condition()

    def append(self, entry: Entry) -> None:
        lines, chars = entry_lines(entry), _chars(entry)
        if not lines:
            return
        with self.changed:
            self._entries.append((self.next, entry, chars))
            self.next += lines
            self._lines += lines
            self._chars += chars
            while len(self._entries) > 1 and (self._lines > self.max_lines or self._chars > self.max_chars):
                _, old, old_chars = self._entries.popleft()
                self._lines -= entry_lines(old)
                self._chars -= old_chars
            self.changed.notify_all()

    def since(self, line: int) -> tuple[int, list[Entry], int]:
        """The entries from line ``line`` on: (the first one's line, the entries, lines lost before them). An
        entry that ``line`` falls inside comes whole (its earlier lines were relayed with it before)."""
        with self.changed:
            kept = [(first, entry) for first, entry, _ in self._entries if first + entry_lines(entry) > line]
            if not kept:  # (the ring always keeps its newest entry: nothing after ``line`` yet)
                return max(line, self.next), [], 0
            first = kept[0][0]
            lost = max(0, first - line)
            entries = [entry for _, entry in kept]
            if first < line:  # the first entry was partly relayed: only its rest
                head = entries[0]
                entries[0] = ["rank", head[1], head[2][line - first :], *head[3:]] if head[0] == "rank" else head
                first = line
            return first, entries, lost

    def ack(self, upto: int) -> None:
        with self.changed:
            self.acked = max(self.acked, min(upto, self.next))
