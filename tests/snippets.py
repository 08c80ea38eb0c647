"""The code blocks of the README and docs/, as a user would paste them (tests/test_doc_snippets.py checks them).

A ```python block runs, unless the line before it is ``<!-- not run: why -->`` (a fragment: a task of a DAG
file, a function's body, a template whose ``...`` is the user's) or it includes a file (``--8<--``: that file's
own tests run it); it is compiled then. A ```bash block is parsed, and the Airflow commands, settings and DAGs
it names are looked up (running it would start Airflow).
"""

from __future__ import annotations

import re
import shlex
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(\s*)```(\w*)\b.*$")
_MARK = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the block's first line of code
    language: str  # "python" or "bash"
    code: str
    not_run: str | None  # why the block does not run, where its page says so

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language == "python" and self.not_run is None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The python and bash blocks of a Markdown page, with the mark on the line before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        language = LANGUAGES.get(fence.group(2))
        if language is not None:
            mark = _MARK.match(lines[i - 1]) if i else None
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            why = mark.group(1) if mark else None
            included = _included(code)
            if included is not None:  # the file's own tests run it
                code, why = (ROOT / included).read_text(), f"a file of its own, {included}"
            found.append(Block(str(page.relative_to(ROOT)), i + 2, language, code, why))
        i = end + 1
    return found


def _included(code: str) -> str | None:
    """The file a block includes whole (pymdownx.snippets: ``--8<-- "path"``, or the path between two ``--8<--``
    lines), or None."""
    lines = [line.strip() for line in code.strip().splitlines()]
    if len(lines) == 1 and lines[0].startswith("--8<--"):
        return lines[0].removeprefix("--8<--").strip().strip("\"'")
    if len(lines) == 3 and lines[0] == lines[2] == "--8<--":
        return lines[1].strip("\"'")
    return None


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def run_page(page_blocks: list[Block], replace: dict[str, str]) -> list[str]:
    """A page's blocks in order in one namespace, as ``__main__`` (its functions travel by value), each with
    ``replace``'s substitutions; it stops at its first failing block. The failures, each named by page and line
    (the tracebacks' lines are the page's)."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for block in page_blocks:
        code = block.code
        for old, new in replace.items():
            code = code.replace(old, new)
        try:
            exec(compile("\n" * (block.line - 1) + code, block.page, "exec"), namespace)
        except BaseException:  # noqa: BLE001 - the block's failure, reported
            return [f"{block.where}:\n{traceback.format_exc()}"]
    return []


def _command_lines(code: str) -> list[list[str]]:
    """A shell block's commands, as words (a line continued with ``\\``, or by a quote, is one)."""
    commands, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(pending + line, comments=True)
        except ValueError:  # a quote that a later line closes
            pending += line + "\n"
            continue
        pending, current = "", []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|"):
                commands.append(current)
                current = []
            else:
                current.append(word)
    return [command for command in commands if command]


def airflow_commands(code: str) -> list[list[str]]:
    """The ``airflow ...`` commands of a shell block, from ``airflow`` on (``docker compose exec SERVICE
    airflow ...`` too)."""
    return [
        command[command.index("airflow") :]
        for command in _command_lines(code)
        if "airflow" in command and command[0] != "make"  # (`make airflow` is a target)
    ]


def exported(code: str) -> dict[str, str]:
    """The variables a shell block exports, with their values (unquoted)."""
    return {
        name: value
        for command in _command_lines(code)
        if command[0] == "export"
        for name, _, value in (word.partition("=") for word in command[1:])
    }
