"""The package's shape, read from its source: no import circles, the launchers apart from the supervision, and the
Airflow layer on the runner's public face only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "airflow_provider_hvd"
DRIVER = f"{PACKAGE}.runner.driver"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Each module of the package by its dotted name: its file, and whether it is a package's ``__init__``."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def imports_of(name: str) -> set[str]:
    """The package's modules that ``name`` imports, wherever the import is: at module level, under
    ``TYPE_CHECKING``, or inside a function (a lazy import is still a dependency)."""
    path, is_package = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import channel` imports a module; `from .x import y` a name of x
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def reached_from(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for module in GRAPH[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def cycles() -> list[list[str]]:
    """Each import circle, as the modules on it (Tarjan's strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(GRAPH[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (popped := stack.pop()) != module:
                component.append(popped)
            if component:
                found.append(sorted([module, *component]))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_circle():
    assert len(GRAPH) > 80 and GRAPH[f"{DRIVER}.watch.supervisor"]  # (the graph was read)
    assert cycles() == []


def test_the_launchers_know_nothing_of_the_supervision():
    """A launcher reports what it knows as events; it reaches neither the supervisor nor the channel."""
    launchers = [name for name in MODULES if name.startswith(f"{DRIVER}.launch.")]
    assert len(launchers) > 10
    supervision = {name for name in MODULES if name.startswith((f"{DRIVER}.watch", f"{DRIVER}.verdict"))}
    reached = {launcher: sorted(reached_from(launcher) & supervision) for launcher in launchers}
    assert not {launcher: found for launcher, found in reached.items() if found}


def test_the_run_events_import_nothing_of_the_driver():
    assert not {name for name in GRAPH[f"{DRIVER}.events"] if name.startswith(DRIVER)}


AIRFLOW_LAYER = ("hooks", "operators", "decorators", "plugins", "triggers")


def test_the_airflow_layer_uses_only_the_runners_public_face():
    """hooks/, operators/, decorators/, plugins/ and triggers/ import ``airflow_provider_hvd.runner`` and the modules
    directly in it (its settings, its Spark helpers, MLflow's settings, its jobs), never the driver, the agent, the
    rank or shared/."""
    public = {f"{PACKAGE}.runner"} | {
        name for name, (path, is_package) in MODULES.items() if not is_package and path.parent.name == "runner"
    }
    layer = [name for name in MODULES if name.partition(".")[2].split(".")[0] in AIRFLOW_LAYER]
    assert len(layer) > 10 and f"{PACKAGE}.runner.settings" in public
    beyond = {
        name: sorted(m for m in GRAPH[name] if m.startswith(f"{PACKAGE}.runner") and m not in public) for name in layer
    }
    assert not {name: found for name, found in beyond.items() if found}


def test_each_run_setting_is_declared_once_with_its_keyword_and_its_docs():
    """RunSettings declares the run settings (their defaults, checks, docs); RunOptions types the same keywords."""
    import dataclasses
    import inspect

    from airflow_provider_hvd.runner.settings import RunOptions, RunSettings

    names = [field.name for field in dataclasses.fields(RunSettings)]
    assert list(RunOptions.__annotations__) == names
    documented = re.findall(r"^:param (\w+):", inspect.getdoc(RunSettings), re.MULTILINE)
    assert [name for name in documented if name in names] == names
