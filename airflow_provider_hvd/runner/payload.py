"""Pickling the job once, with the user's own modules by value so that ranks need not import them."""

from __future__ import annotations

import contextlib
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

# cloudpickle's by-value registry is global: runs pickling at once in one process take turns
_BY_VALUE_LOCK = threading.Lock()


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    return [Path(root).resolve() for root in roots]


def is_installed(module: ModuleType) -> bool:
    """True for modules of the standard library and of installed distributions, which every rank can import."""
    file = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not file:
        return False
    path = Path(file).resolve()
    return any(path.is_relative_to(root) for root in _installed_roots())


@contextlib.contextmanager
def _by_value(modules: Sequence[ModuleType]) -> Iterator[None]:
    registered = []
    for module in modules:
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:
            continue  # not in sys.modules (e.g. an Airflow DAG file's private name): cloudpickle by-value-s it anyway
        registered.append(module)
    try:
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def dumps_job(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """Pickle ``(fn, args, kwargs)``; ``fn``'s module goes by value unless it is installed.

    Notebooks, scripts, test files and Airflow DAG files (imported under names that executors cannot
    import) are thus shipped with the job; installed packages are imported by the ranks.
    """
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = [module] if module is not None and not is_installed(module) else []
    with _BY_VALUE_LOCK, _by_value(by_value):
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
