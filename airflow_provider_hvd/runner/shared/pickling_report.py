"""What a pickled job is made of: the sizes of its parts, and where an object that cannot be pickled sits.

Parts are named by their path from ``main`` or an argument, e.g. ``main → global 'db' → attribute '_lock'``.
A function pickled by value carries the globals its code reads, its closure variables, its default values
and its attributes; that is what the walk follows. Callers hold cloudpickle's by-value registration for the
job's module, so that the walk sees what the payload holds.
"""

from __future__ import annotations

import functools
import inspect
import reprlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle

# cloudpickle's own answers (pinned <3.2): does a function go by reference, and what it carries by value
from cloudpickle.cloudpickle import _function_getstate, _should_pickle_by_reference

from .code_source import JobPickler

_ARROW = " → "
_MAX_DEPTH = 100
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_short_repr = _repr.repr


class _ByteCounter:
    """A write-only file that only counts: sizing a part keeps no copy of its bytes."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def pickled_size(obj: Any) -> int:
    """The number of bytes the job's pickler (:mod:`.code_source`) writes for ``obj``, counted as they are written."""
    counter = _ByteCounter()
    JobPickler(counter).dump(obj)
    return counter.size


def format_size(n: int) -> str:
    """``512 B``, ``12.3 KB``, ``40.0 MB``, ``2.1 GB`` (powers of 1000)."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("KB", "MB", "GB"):
        value /= 1000
        if value < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


def format_path(path: Sequence[str], keep: int = 5) -> str:
    """``main → global 'db' → attribute '_lock'``; a very deep path keeps its two ends."""
    if len(path) > 2 * keep + 1:
        path = [*path[:keep], f"… {len(path) - 2 * keep} more …", *path[-keep:]]
    return _ARROW.join(path)


def _key(key: Any) -> str:
    plain = isinstance(key, str | bytes | int | float | bool | None)
    return _short_repr(key) if plain else f"<a {type_name(key)}>"


def type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def job_roots(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``main`` and each argument, named as the user wrote them (positional ones by their parameter's name)."""
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    roots: list[tuple[str, Any]] = [("main", fn)]
    roots += [(f"argument {params[i]!r}" if i < len(params) else f"argument #{i}", arg) for i, arg in enumerate(args)]
    roots += [(f"argument {name!r}", value) for name, value in kwargs.items()]
    return roots


def _by_value_function(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType) and not _should_pickle_by_reference(obj)


def _function_parts(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """What cloudpickle ships with a function pickled by value."""
    state, slots = _function_getstate(fn)
    for name, value in slots["__globals__"].items():
        yield f"global {name!r}", value
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:
            continue  # an empty cell (the variable is not assigned yet)
    defaults = fn.__defaults__ or ()
    with_defaults = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
    yield from ((f"default of {name!r}", value) for name, value in zip(with_defaults, defaults, strict=False))
    yield from ((f"default of {name!r}", value) for name, value in (fn.__kwdefaults__ or {}).items())
    yield from ((f"attribute {name!r}", value) for name, value in state.items())


def _reduced_parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """An object's parts as pickle sees them: constructor arguments, attributes (state), items."""
    try:
        reduced = obj.__reduce_ex__(cloudpickle.DEFAULT_PROTOCOL)
    except Exception:  # noqa: BLE001 - the object itself refuses to be pickled: it is the culprit
        return
    if not isinstance(reduced, tuple):
        return  # pickled by name
    constructor_args, state, list_items, dict_items = (list(reduced[1:5]) + [None] * 4)[:4]
    for i, arg in enumerate(constructor_args or ()):
        yield (f"class {arg.__qualname__!r}" if isinstance(arg, type) else f"constructor argument #{i}"), arg
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict | None) for s in state):
        state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__ values)
    if isinstance(state, dict):
        yield from ((f"attribute {name!r}", value) for name, value in state.items())
    elif state is not None:
        yield "state", state
    yield from ((f"item {i}", item) for i, item in enumerate(list_items or ()))
    yield from ((f"key {_key(key)}", value) for key, value in dict_items or ())


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    if _by_value_function(obj):
        yield from _function_parts(obj)
    elif isinstance(obj, types.MethodType):
        yield "self", obj.__self__
        yield "function", obj.__func__
    elif isinstance(obj, functools.partial):
        yield "partial's function", obj.func
        yield from ((f"partial's argument #{i}", arg) for i, arg in enumerate(obj.args))
        yield from ((f"partial's argument {name!r}", value) for name, value in obj.keywords.items())
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"dict key {_key(key)}", key
            yield f"key {_key(key)}", value
    elif isinstance(obj, list | tuple):
        yield from ((f"item {i}", item) for i, item in enumerate(obj))
    elif isinstance(obj, set | frozenset):
        yield from ((f"member {_key(item)}", item) for item in obj)
    elif isinstance(obj, type):
        if not _should_pickle_by_reference(obj):
            skip = ("__dict__", "__weakref__")
            yield from ((f"class attribute {k!r}", v) for k, v in vars(obj).items() if k not in skip)
    else:
        yield from _reduced_parts(obj)


def _size_if_picklable(obj: Any) -> int | None:
    try:
        return pickled_size(obj)
    except Exception:  # noqa: BLE001 - any failure means: not this one
        return None


def _first_unpicklable_part(obj: Any, skip: set[int]) -> tuple[str, Any] | None:
    try:
        return next(
            ((label, part) for label, part in _parts(obj) if id(part) not in skip and _size_if_picklable(part) is None),
            None,
        )
    except Exception:  # noqa: BLE001 - an object whose parts cannot be listed: the walk stops at it
        return None


def find_unpicklable(roots: Sequence[tuple[str, Any]]) -> tuple[list[str], Any] | None:
    """The path to the innermost object that cannot be pickled, and that object; None if every root pickles."""
    for label, obj in roots:
        if _size_if_picklable(obj) is not None:
            continue
        path, on_path = [label], {id(obj)}
        while len(path) < _MAX_DEPTH and (bad := _first_unpicklable_part(obj, on_path)) is not None:
            path.append(bad[0])
            obj = bad[1]
            on_path.add(id(obj))
        return path, obj
    return None


def largest_parts(roots: Sequence[tuple[str, Any]], count: int = 5) -> list[tuple[str, int]]:
    """The ``count`` largest parts by pickled size: functions pickled by value are opened up (a helper's
    globals count as the job's), everything else is one part; an object reached twice counts once."""
    leaves: list[tuple[str, Any]] = []
    seen: set[int] = set()
    pending: list[tuple[tuple[str, ...], Any]] = [((label,), obj) for label, obj in reversed(roots)]
    while pending:
        path, obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _by_value_function(obj):
            pending += [((*path, label), child) for label, child in reversed(list(_function_parts(obj)))]
        else:
            leaves.append((format_path(path), obj))
    sized = [(path, size) for path, obj in leaves if (size := _size_if_picklable(obj)) is not None]
    return sorted(sized, key=lambda part: -part[1])[:count]
