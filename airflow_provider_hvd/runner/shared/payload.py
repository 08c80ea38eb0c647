"""Pickling the job once, with the user's own modules by value so that ranks need not import them (their code
keeping its file and lines: :mod:`.code_source`).

Before anything starts, the job's size is logged, a large job is warned about with its largest parts, and
a job that cannot be pickled is refused with where the problem sits and what to do instead. The job does not
travel over the driver channel (see the launchers), so no frame limit applies to it; rank 0's result does
travel in one frame, and :func:`check_fits_frame` refuses one that is too large.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from . import code_source, wire
from .naming import HOROVOD_RUNNER
from .pickling_report import (
    find_unpicklable,
    format_path,
    format_size,
    job_roots,
    largest_parts,
    pickled_size,
    type_name,
)

log = logging.getLogger("airflow_provider_hvd.runner")

WARN_BYTES = 10_000_000  # sparkdl's threshold too
MAX_FRAME_ENV = "HVD_RUNNER_MAX_FRAME_BYTES"  # lowers the frame limit (tests), in the driver and in the ranks
_FRAME_LENGTH_MAX = 0xFFFF_FFFF  # a frame header's length field is a 4-byte unsigned int
_INSTEAD = "load large data inside main (from a file or a table) or pass its path, instead of capturing or passing it"
# cloudpickle's by-value registry is global: runs pickling at once in one process take turns
_BY_VALUE_LOCK = threading.Lock()


@functools.cache  # asked once per module beside main's, on every run; the roots do not change
def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    return tuple(Path(root).resolve() for root in roots)


def is_installed(module: ModuleType) -> bool:
    """True for modules of the standard library and of installed distributions, which every rank can import."""
    file = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not file:
        return False
    path = Path(file).resolve()
    return any(path.is_relative_to(root) for root in _installed_roots())


@functools.cache
def _distributed_packages() -> frozenset[str]:
    """The top-level packages of installed distributions, editable ones included (whose files are not under
    site-packages): the ranks import them."""
    return frozenset(importlib.metadata.packages_distributions())


@functools.lru_cache(maxsize=8192)
def _real_path(file: str) -> str:
    """``file`` with symbolic links resolved: a script run through a link to its folder imports its helpers
    from the link's target (``sys.path[0]`` is resolved), so both sides are compared resolved."""
    return os.path.realpath(file)


def modules_beside(module: ModuleType) -> list[ModuleType]:
    """The imported modules in ``module``'s folder or below it that are not installed: a ``helpers.py`` beside
    the script, DAG file or test file that defines ``main``, which the ranks cannot import either."""
    file = getattr(module, "__file__", None)
    if not file:  # a notebook's or a REPL's __main__: no folder to go by
        return []
    folder = os.path.join(os.path.dirname(_real_path(file)), "")
    # each module once: one may be in sys.modules under several names (multiprocessing, which torch imports,
    # makes __mp_main__ an alias of __main__)
    imported = {id(other): other for other in list(sys.modules.values())}.values()
    beside = [
        other
        for other in imported
        if other is not module
        and isinstance(other_file := getattr(other, "__file__", None), str)
        and _real_path(other_file).startswith(folder)
        and not is_installed(other)
    ]
    if beside:
        beside = [other for other in beside if other.__name__.partition(".")[0] not in _distributed_packages()]
    return beside


@contextlib.contextmanager
def _by_value(modules: Sequence[ModuleType]) -> Iterator[None]:
    """``modules`` pickled by value inside the ``with``. cloudpickle's registry holds module names: each name is
    registered once, and one registered before (by the user) stays registered afterwards."""
    registered: dict[str, ModuleType] = {}
    already = cloudpickle.list_registry_pickle_by_value()
    for module in modules:
        if module.__name__ in registered or module.__name__ in already:
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:
            continue  # not in sys.modules (e.g. an Airflow DAG file's private name): cloudpickle by-value-s it anyway
        registered[module.__name__] = module
    try:
        yield
    finally:
        for module in registered.values():
            cloudpickle.unregister_pickle_by_value(module)


def max_frame_bytes() -> int:
    """The largest frame the driver channel carries: ``wire.MAX_FRAME_BYTES``, or less if the environment
    variable ``HVD_RUNNER_MAX_FRAME_BYTES`` says so (tests set it; local runs' rank processes inherit it)."""
    limit = min(wire.MAX_FRAME_BYTES, _FRAME_LENGTH_MAX)
    lowered = os.environ.get(MAX_FRAME_ENV)
    return min(limit, int(lowered)) if lowered else limit


def check_fits_frame(size: int, what: str, advice: str) -> None:
    """``ValueError`` when ``size`` bytes of ``what`` cannot travel in one frame of the driver channel."""
    limit = max_frame_bytes()
    if size > limit:
        raise ValueError(
            f"{what} pickles to {format_size(size)}, more than the {format_size(limit)} the driver channel "
            f"carries in one frame; {advice}"
        )


def _unpicklable_error(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], exc: Exception
) -> TypeError:
    found = find_unpicklable(job_roots(fn, args, kwargs))
    if found is None:
        return TypeError(f"main and its arguments cannot be pickled to travel to the ranks: {exc}")
    path, culprit = found
    return TypeError(
        f"{format_path(path)} is a {type_name(culprit)}, which cannot be pickled to travel to the ranks "
        f"({type(exc).__name__}: {exc}); create it inside main, or pass what is needed to build it there "
        "(a path, a URL, settings)"
    )


def _check_size(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], size: int, warn_bytes: int, runner: str
) -> None:
    main_size = pickled_size(fn)
    log.info(
        "%s: the pickled job is %s: main (%s) %s, its arguments %s",
        runner,
        format_size(size),
        getattr(fn, "__qualname__", type_name(fn)),
        format_size(main_size),
        format_size(max(size - main_size, 0)),
    )
    if size <= warn_bytes:
        return
    largest = largest_parts(job_roots(fn, args, kwargs))
    largest = largest[:1] + [(path, n) for path, n in largest[1:] if n * 100 >= size]  # not the crumbs
    parts = "; ".join(f"{path}: {format_size(n)}" for path, n in largest)
    log.warning(
        "%s: the pickled job is %s (over %s): every rank loads it before it starts, which "
        "slows the start. Largest parts: %s. To make it smaller, %s",
        runner,
        format_size(size),
        format_size(warn_bytes),
        parts,
        _INSTEAD,
    )


def _modules_by_value(fn: Callable[..., Any]) -> list[ModuleType]:
    """``fn``'s module and the modules beside it, unless it is installed: what goes by value with ``fn``."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    return [module, *modules_beside(module)] if module is not None and not is_installed(module) else []


def dumps_callable(fn: Callable[..., Any], what: str) -> bytes:
    """``fn`` alone, pickled as :func:`dumps_job` pickles main (its module by value unless installed); TypeError
    naming ``what`` when it cannot be pickled."""
    with _BY_VALUE_LOCK, _by_value(_modules_by_value(fn)):
        try:
            pickled = code_source.dumps(fn)
        except MemoryError:
            raise
        except Exception as exc:
            raise TypeError(
                f"{what}, {getattr(fn, '__qualname__', type_name(fn))}, cannot be pickled to travel to the run's "
                f"host ({type(exc).__name__}: {exc}); build what it needs inside it"
            ) from exc
    return pickled


def dumps_job(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    warn_bytes: int = WARN_BYTES,
    runner: str = HOROVOD_RUNNER.runner,
) -> bytes:
    """Pickle ``(fn, args, kwargs)``; ``fn``'s module goes by value unless it is installed, and so do the modules
    beside it that are not installed (:func:`modules_beside`).

    Notebooks, scripts, test files and Airflow DAG files (imported under names that executors cannot
    import), and the helper modules next to them, are thus shipped with the job; installed packages are
    imported by the ranks. Logs the sizes under ``runner``'s name (a warning naming the largest parts above
    ``warn_bytes``); raises
    ``TypeError`` naming where an unpicklable object sits.
    """
    with _BY_VALUE_LOCK, _by_value(_modules_by_value(fn)):
        try:
            payload = code_source.dumps((fn, tuple(args), dict(kwargs)))
        except MemoryError:
            raise
        except Exception as exc:
            raise _unpicklable_error(fn, args, kwargs, exc) from exc
        _check_size(fn, args, kwargs, len(payload), warn_bytes, runner)  # sizes parts under the same registration
    return payload
