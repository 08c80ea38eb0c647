"""The rank's activity, for the driver's stall clock (runs in the agent).

While stall detection is on (``AgentArgs.activity_every_s``), the agent sends a bare
:class:`~..shared.messages.RankState` at most once per period in which its rank wrote output or sent a
message on its control pipe (``log_to_driver``, metrics, its result). Nothing is sent while the rank is quiet:
that silence is what the driver measures. Horovod's own stall warning (a collective that some ranks have not
joined for 60 s, repeated) is not activity: it is the symptom.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from ..shared.messages import RankState, send
from ..shared.wire import FrameStream

# horovod/common/stall_inspector.cc: "One or more tensors were submitted to be reduced, ...", "Missing ranks:",
# then a "<rank>: [<tensor names>]" line per missing rank ("<rank>!: ..." once past the shutdown time)
_HOROVOD_STALL = re.compile(
    r'One or more tensors were submitted to be|One or more rank \(marked by "!"\)|^Missing ranks:$|^\d+!?: \['
)


def is_stall_warning(piece: str | int) -> bool:
    """Whether a line of output is Horovod's stall warning (which must not count as the rank's activity)."""
    return isinstance(piece, str) and _HOROVOD_STALL.search(piece) is not None


class ActivityReporter:
    def __init__(self, stream: FrameStream, period_s: float, last_active: Callable[[], float]) -> None:
        self._stream = stream
        self._period_s = period_s
        self._last_active = last_active
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd-agent-activity", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reported = time.monotonic()  # the driver starts its clock when it starts the rank
        while not self._stop.wait(self._period_s):
            active = self._last_active()
            if active > reported:
                reported = active
                try:
                    send(self._stream, RankState())
                except OSError:
                    return  # the driver is gone; the agent's watcher ends the rank

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
