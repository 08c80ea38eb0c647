"""Griffe extension for the docs build (mkdocs.yml): the run settings in the signatures and parameters they are in.

The runners, the hook's ``run`` and the operators take the run settings as ``**settings`` (or among an operator's
``**kwargs``), their signatures made at import by ``takes_run_settings`` from ``RunSettings``
(``airflow_provider_hvd/runner/settings.py``). The docs are read statically: this does the same from the source,
so that each such signature names every setting with its default (the decorator's own, else the declared one),
and the docstring of its owner (the class, whose ``__init__`` the docs merge into it, or the function) has each
setting's ``:param:`` from ``RunSettings``' docstring.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import griffe

SETTINGS = "airflow_provider_hvd.runner.settings"
_DECORATOR = "takes_run_settings"
_PARAM = re.compile(r"^:param (\w+):", re.MULTILINE)


def _value(expr: object, module: griffe.Module) -> Any:
    """A literal in the source (``"all"``, ``600.0``, ``None``), or a constant of ``module`` named so."""
    text = str(expr)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _value(module[text].value, module)


@dataclass(frozen=True)
class _Setting:
    name: str
    annotation: str  # as given (RunOptions')
    default: Any  # as declared
    task: bool  # a training task takes it
    doc: str  # its ``:param:`` in RunSettings' docstring


def _with_links(obj: griffe.Object) -> None:
    """``obj``'s docstring with its Sphinx roles made links in its own scope (``griffe_sphinx_roles.py``), before
    its text goes into other docstrings, where the names it uses may not resolve."""
    spec = importlib.util.spec_from_file_location(
        "griffe_sphinx_roles", Path(__file__).with_name("griffe_sphinx_roles.py")
    )
    assert spec is not None and spec.loader is not None
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    roles.SphinxRoles().on_object(obj=obj)


def _declared(settings: griffe.Module) -> list[_Setting]:
    """The run settings, in their order, from the source of ``RunSettings`` (``_setting(default, check, task=)``)."""
    run_settings, options = settings["RunSettings"], settings["RunOptions"]
    _with_links(run_settings)
    docstring = run_settings.docstring.value if run_settings.docstring else ""
    starts = [(match.start(), match[1]) for match in _PARAM.finditer(docstring)]
    ends = [start for start, _ in starts[1:]] + [len(docstring)]
    docs = {name: docstring[start:end].strip() for (start, name), end in zip(starts, ends, strict=True)}
    found = []
    for name, member in run_settings.members.items():
        if not member.is_attribute or member.value is None:
            continue
        call = ast.parse(str(member.value), mode="eval").body
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "_setting"):
            continue
        task = next((ast.literal_eval(kw.value) for kw in call.keywords if kw.arg == "task"), True)
        default = _value(ast.unparse(call.args[0]), settings)
        found.append(_Setting(name, str(options[name].annotation), default, task, docs[name]))
    return found


class RunSettingsInSignatures(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != SETTINGS.split(".")[0]:
            return
        settings = pkg["runner.settings"]
        declared = _declared(settings)
        for function in _decorated(pkg):
            decorator = next(d for d in function.decorators if _DECORATOR in str(d.value))
            call = ast.parse(str(decorator.value), mode="eval").body
            assert isinstance(call, ast.Call)
            task, defaults = False, {}
            for keyword in call.keywords:
                if keyword.arg is None:  # **PYSPARK_DEFAULTS
                    defaults.update(_value(ast.unparse(keyword.value), settings))
                elif keyword.arg == "task":
                    task = ast.literal_eval(keyword.value)
                else:
                    defaults[keyword.arg] = ast.literal_eval(keyword.value)
            taken = [setting for setting in declared if setting.task or not task]
            _add_parameters(function, taken, defaults, task)
            owner = function.parent if function.name == "__init__" else function
            if owner is not None and owner.docstring is not None:
                owner.docstring.value = (
                    owner.docstring.value.rstrip() + "\n\n" + "\n".join(setting.doc for setting in taken)
                )


def _decorated(obj: griffe.Object) -> list[griffe.Function]:
    found = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_function and any(_DECORATOR in str(d.value) for d in member.decorators):
            found.append(member)
        elif member.is_module or member.is_class:
            found += _decorated(member)
    return found


def _add_parameters(function: griffe.Function, taken: list[_Setting], defaults: dict[str, Any], task: bool) -> None:
    """The settings as keyword-only parameters before the function's ``**`` parameter (an operator keeps its
    ``**kwargs``; a runner's ``**settings`` is what they replace)."""
    parameters = list(function.parameters)
    variadic = [p for p in parameters if p.kind is griffe.ParameterKind.var_keyword]
    own = [p for p in parameters if p.kind is not griffe.ParameterKind.var_keyword]
    added = [
        griffe.Parameter(
            setting.name,
            annotation=setting.annotation,
            kind=griffe.ParameterKind.keyword_only,
            default=repr(defaults.get(setting.name, setting.default)),
        )
        for setting in taken
    ]
    function.parameters = griffe.Parameters(*own, *added, *(variadic if task else []))
