"""Griffe extension for the docs build (mkdocs.yml): Sphinx roles in docstrings become cross-references.

The package's docstrings use Sphinx roles (:class:`LaunchError`, :meth:`HorovodRunner.cancel`,
:func:`~.control.log_to_driver`). This turns each into an mkdocs-autorefs link to the object's documented
path, resolved from the docstring's own scope; a target that resolves nowhere is kept as a link to the name
as written, so that the strict build fails on it instead of showing a dead reference.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

PACKAGE = "airflow_provider_hvd"
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)`")


def _module_of(obj: griffe.Object) -> griffe.Object:
    while not obj.is_module and obj.parent is not None:
        obj = obj.parent
    return obj


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path ``target`` names where ``obj``'s docstring uses it, or None."""
    if target.startswith("."):
        module = _module_of(obj)
        base = module if module.is_package else module.parent
        dots = len(target) - len(target.lstrip("."))
        for _ in range(dots - 1):
            base = base.parent if base is not None else None
        return f"{base.path}.{target.lstrip('.')}" if base is not None else None
    first, _, rest = target.partition(".")
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += [obj.parent] if obj.parent is not None else []
    for scope in scopes:
        if scope.is_class and first in scope.all_members:  # :meth:`run` inside a class
            return f"{scope.path}.{target}"
        try:
            return f"{scope.resolve(first)}{'.' + rest if rest else ''}"
        except griffe.NameResolutionError:
            continue
    package = obj.package
    for path in (f"runner.{first}", first):  # the public names, from docstrings whose module does not import them
        try:
            member = package[path]
        except (KeyError, griffe.AliasResolutionError):
            continue
        found = member.final_target.path if member.is_alias else member.path
        return f"{found}{'.' + rest if rest else ''}"
    return None


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None or obj.path.split(".")[0] != PACKAGE:
            return

        def link(match: re.Match[str]) -> str:
            target = match["target"]
            shown = target.lstrip(".").rsplit(".", 1)[-1] if match["tilde"] else target.lstrip(".")
            return f"[`{shown}`][{_resolve(obj, target) or target}]"

        obj.docstring.value = _ROLE.sub(link, obj.docstring.value)
