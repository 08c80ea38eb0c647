"""The error a run raised, as parts that travel over the link, and the same error rebuilt from them.

``run()``'s errors (:mod:`..errors`) come back as the same class with the same message and attributes
(``rank``, ``remote_traceback``, ``stacks``, ...). Anything else the host raised (a bug) comes back as a
:class:`~..errors.HorovodRunnerError` naming it, with its traceback. The parts are JSON, with the attributes
pickled (plain data only), read only from an authenticated host.
"""

from __future__ import annotations

import base64
import pickle
import traceback
from typing import Any

from .. import errors

_CLASSES: dict[str, type[errors.HorovodRunnerError]] = {
    cls.__name__: cls
    for cls in (
        errors.HorovodRunnerError,
        errors.LaunchError,
        errors.RankFailedError,
        errors.RunCancelledError,
        errors.RunStalledError,
    )
}


def error_parts(error: BaseException) -> dict[str, Any]:
    if type(error).__name__ in _CLASSES and isinstance(error, errors.HorovodRunnerError):
        attributes = base64.b64encode(pickle.dumps(vars(error))).decode()
        return {"type": type(error).__name__, "message": str(error), "attributes": attributes}
    text = "".join(traceback.format_exception(error))
    return {
        "type": errors.HorovodRunnerError.__name__,
        "message": f"the run's host failed: {type(error).__name__}: {error}\n{text}",
        "attributes": None,
    }


def rebuild_error(parts: dict[str, Any]) -> errors.HorovodRunnerError:
    cls = _CLASSES.get(str(parts.get("type")), errors.HorovodRunnerError)
    error = cls.__new__(cls)
    Exception.__init__(error, str(parts.get("message", "")))
    if parts.get("attributes"):
        vars(error).update(pickle.loads(base64.b64decode(parts["attributes"])))
    return error


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
