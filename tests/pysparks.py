"""PySpark's own TorchDistributor as the tests' reference, its launch's own race aside."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_TRIES = 3
# torchrun's store failing to listen on the port PySpark chose for it (torch's TCPStore, in its output)
_PORT_TAKEN = "EADDRINUSE"


def pysparks_result(run: Callable[[], T], capfd: Any) -> T:
    """What ``run`` (a call of PySpark's TorchDistributor on Spark) returns, trying again (3 tries at most) a launch
    that failed on PySpark's own port race, whose evidence is in its output (``capfd``).

    PySpark's barrier task finds a port free by binding it on the executor's address and closing it; torchrun's
    store binds it later, on every address. A port taken meanwhile, or held on another address (the suite's other
    servers), fails the store with EADDRINUSE, and PySpark's wrapper exits 0 all the same: "TorchDistributor
    failed during training". That is PySpark's launch, not the training the tests compare; any other failure is
    raised with PySpark's output (its torchrun's lines).
    """
    for tries_left in reversed(range(_TRIES)):
        capfd.readouterr()
        try:
            return run()
        except Exception as exc:
            output = "".join(capfd.readouterr())
            if _PORT_TAKEN not in output or not tries_left:
                raise AssertionError(
                    f"PySpark's TorchDistributor failed: {exc}\n--- its output ---\n{output[-8000:]}"
                ) from exc
    raise AssertionError("unreachable")
