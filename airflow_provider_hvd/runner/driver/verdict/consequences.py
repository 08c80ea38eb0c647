"""Which rank failures are consequences of another rank's failure, Horovod's or torch's (used by the driver).

When one rank fails, Horovod shuts down on every other rank: a rank inside a collective then raises
``HorovodInternalError: Horovod has been shut down ...`` (TensorFlow: an ``UnknownError`` or ``AbortedError``
with the same text), and a rank whose peer process died may see Gloo's connection errors, or be aborted by
an uncaught ``gloo::IoException``. torch.distributed's ranks raise its ``DistBackendError`` (Gloo's
``Connection closed by peer``, NCCL's errors), ``DistNetworkError`` or ``DistStoreError`` (a store timeout),
or are aborted by NCCL's watchdog. None of these says why the run failed. See docs/failures.md. Both kinds'
words are checked whatever the run's kind: neither is ever a real cause in the other's run.
"""

from __future__ import annotations

from ...shared.messages import Done, RemoteError

SHUTDOWN_ERRORS = frozenset({"HorovodInternalError"})  # the exception types Horovod raises once it shut down
# torch.distributed's exception types when a peer is gone, a collective or the store timed out
TORCH_ERRORS = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})
TORCH_ABORTED = (  # what a torch rank aborted by C++ (no Python exception) left at the end of its output
    "c10::DistBackendError",
    "c10::DistNetworkError",
    "c10::DistStoreError",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
)
SHUTDOWN_TEXT = "Horovod has been shut down"
GLOO_PEER_GONE = (  # Gloo's words when a peer's process died or closed its connections
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)
_TAIL_LINES_READ = 20  # a rank aborted without a Python exception: Gloo's message is at the end of its output


def _says_peer_gone(text: str) -> bool:
    if SHUTDOWN_TEXT in text or any(words in text for words in TORCH_ABORTED):
        return True
    return ("gloo" in text.lower()) and any(words in text for words in GLOO_PEER_GONE)


def is_consequence_error(error: RemoteError) -> bool:
    """``error`` is Horovod's, torch.distributed's (or Gloo's) reaction to another rank's failure, not a cause."""
    return error.type in SHUTDOWN_ERRORS or error.type in TORCH_ERRORS or _says_peer_gone(error.message)


def is_consequence(done: Done) -> bool:
    """The rank ended because another rank failed: by such an error, or aborted by Gloo or NCCL's watchdog."""
    if done.error is not None:
        return is_consequence_error(done.error)
    if done.exit_code == 0:
        return False
    return any(_says_peer_gone(line) for line in done.tail[-_TAIL_LINES_READ:])
