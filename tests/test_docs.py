"""The README and the changelog, which the strict docs build (`make docs`) does not read: short, their links
alive, and the source archive carries what they point to. And facts the docs state that the code decides."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: Path) -> list[str]:
    """The targets of the file's Markdown links that are neither URLs nor anchors on the same page."""
    return [t for t in _LINK.findall(markdown.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the details into docs/"


def test_the_readme_and_changelog_link_to_files_that_exist():
    for name in ("README.md", "CHANGELOG.md"):
        missing = [t for t in relative_links(ROOT / name) if not (ROOT / t.split("#")[0]).exists()]
        assert not missing, f"{name} links to files that do not exist: {missing}"
    assert any(t.startswith("docs/") for t in relative_links(ROOT / "README.md"))


def test_the_changelog_has_an_unreleased_section_and_dated_versions():
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased"
    assert all(re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", h) for h in headings[1:]), headings


def test_the_source_archive_carries_the_docs_and_what_the_readme_runs(tmp_path):
    # from a clean copy: an egg-info left by an earlier build would list its files again
    source = tmp_path / "source"
    leftovers = shutil.ignore_patterns(".*", "*.egg-info", "build", "dist", "site", "airflow_home", "__pycache__")
    shutil.copytree(ROOT, source, ignore=leftovers)
    build = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / done.stdout.split()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {"docs/index.md", "mkdocs.yml", "CHANGELOG.md", "constraints.txt", "scripts/install_horovod.py"}
    assert wanted <= names, f"missing from the sdist: {sorted(wanted - names)}"


def test_the_docs_build_fails_on_a_broken_link_or_reference(tmp_path):
    """mkdocs.yml itself is strict: a dead link, a missing anchor or an unresolved reference fails the build."""
    for part in ("docs", "airflow_provider_hvd", "scripts"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / part, tmp_path / part)
    build = [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(tmp_path / "site")]
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\n[gone](gone.md) [no anchor](guide/runner.md#nowhere) [nothing][airflow_provider_hvd.Nothing]\n")
    broken = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode != 0
    for named in ("gone.md", "#nowhere", "airflow_provider_hvd.Nothing"):
        assert named in broken.stderr, broken.stderr


FRAMEWORKS = {"PYTORCH": "PyTorch", "TENSORFLOW": "TensorFlow", "MXNET": "MXNet", "MPI": "MPI", "GLOO": "Gloo"}
_MARK = r"\b(?:with|without|no|not|are not built|is not built)\b"
# "with X and Y", "without X or Y", "no X", "not X" (up to the next of these, or the clause's end); "X are not built"
_CLAIM = re.compile(rf"\b(with|without|no|not)\b((?:(?!{_MARK})[^.;:()|])*)|([^.;:()|]*)\b(?:are|is) not built\b")


def doc_blocks(markdown: str) -> list[str]:
    """Paragraphs, list items and table rows: the units a claim stays within. A list item comes with the
    paragraph that leads into its list ("The script:" and "- builds Horovod with ...")."""
    blocks: list[list[str]] = [[]]
    for line in markdown.splitlines():
        starts = not line.strip() or re.match(r"\s*(\||[-*] |\d+\. )", line)
        if starts and blocks[-1]:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    joined, lead = [], ""
    for text in (" ".join(block) for block in blocks if block):
        item = re.match(r"\s*([-*] |\d+\. )", text)
        joined.append(f"{lead} {text}" if item else text)
        lead = text if text.endswith(":") else lead if item else ""
    return joined


def test_the_docs_say_what_the_installer_builds_horovod_with():
    """Where a page says which frameworks scripts/install_horovod.py builds Horovod with or without, it says
    what the script's build switches say (TensorFlow is built in when the environment has it)."""
    spec = importlib.util.spec_from_file_location("install_horovod", ROOT / "scripts" / "install_horovod.py")
    installer = importlib.util.module_from_spec(spec)
    sys.modules["install_horovod"] = installer  # its dataclasses look their module up
    try:
        spec.loader.exec_module(installer)
        switches = installer.cpu_variant(tensorflow=True).env
    finally:
        del sys.modules["install_horovod"]
    with_ = {FRAMEWORKS[k.removeprefix("HOROVOD_WITH_")] for k in switches if k.startswith("HOROVOD_WITH_")}
    without = {FRAMEWORKS[k.removeprefix("HOROVOD_WITHOUT_")] for k in switches if k.startswith("HOROVOD_WITHOUT_")}
    assert with_ == {"PyTorch", "TensorFlow", "Gloo"} and without == {"MPI", "MXNet"}, switches  # the names above
    wrong, checked = [], 0
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        for block in doc_blocks(page.read_text()):
            if "install_horovod.py" not in block:
                continue
            for word, named, not_built in _CLAIM.findall(block):
                word, named = (word, named) if word else ("without", not_built)
                said = {name for name in FRAMEWORKS.values() if re.search(rf"\b{name}\b", named)}
                checked += bool(said)
                if said - (with_ if word == "with" else without):
                    wrong.append(f"{page.relative_to(ROOT)}: {word!r} {sorted(said)}: {block[:160]}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 4  # the installation page, compatibility, sparkdl's comparison and the TensorFlow page


def markdown_table(page: Path, heading: str) -> list[list[str]]:
    """The cells of each row of the first table under ``## heading`` on ``page`` (its header row left out)."""
    section = page.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_the_internals_module_table_lists_every_module_of_the_runner():
    runner = ROOT / "airflow_provider_hvd" / "runner"
    modules = {str(p.relative_to(runner)) for p in runner.rglob("*.py") if p.name != "__init__.py"}
    listed = [
        m.group(1)
        for row in markdown_table(ROOT / "docs" / "internals.md", "The processes")
        if (m := re.fullmatch(r"`([\w/]+\.py)`", row[0]))
    ]
    assert len(listed) == len(set(listed)), sorted(name for name in listed if listed.count(name) > 1)
    assert not modules - set(listed), f"modules missing from docs/internals.md's table: {sorted(modules - set(listed))}"
    assert not set(listed) - modules, f"docs/internals.md lists modules that are gone: {sorted(set(listed) - modules)}"


def thread_names(package: Path) -> dict[str, str]:
    """The name of every thread the package's code makes (``<>`` for what an f-string fills in), and where."""

    def name_of(call: ast.Call, where: str) -> str:
        given = next((k.value for k in call.keywords if k.arg == "name"), None)
        assert given is not None, f"{where}: a thread without a name (name it, and list it in docs/internals.md)"
        if isinstance(given, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "<>" for v in given.values)
        assert isinstance(given, ast.Constant), f"{where}: a thread name that is neither a string nor an f-string"
        return str(given.value)

    names: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        thread_classes = {  # classes that derive from Thread: their super().__init__(name=...)
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("Thread") for base in node.bases)
        }
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("Thread")]
        calls += [
            n
            for cls in thread_classes
            for n in ast.walk(cls)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "super().__init__"
        ]
        for call in calls:
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            names[name_of(call, where)] = where
    return names


def test_the_internals_thread_table_lists_every_thread_the_code_starts():
    in_code = thread_names(ROOT / "airflow_provider_hvd")
    rows = markdown_table(ROOT / "docs" / "internals.md", "Threads")
    listed = {re.sub(r"<\w+>", "<>", m.group(1)) for row in rows if (m := re.fullmatch(r"`([\w<>-]+)`", row[0]))}
    assert len(in_code) >= 10 and all(len(row) == 4 for row in rows)  # what it does, who starts it, how it ends
    missing = {name: where for name, where in in_code.items() if name not in listed}
    assert not missing, f"threads missing from docs/internals.md's thread table: {missing}"
    assert not listed - set(in_code), f"docs/internals.md lists threads that are gone: {sorted(listed - set(in_code))}"


# What ends a rank, or makes its agent end it, by the name of the call: the driver's Abort to an agent, the
# channel closing a proven agent's connection (``_lost``) or every one (``channel.close``), the launcher's cancel
# of the Spark job, the agent's end of its rank process (``terminate``: SIGTERM to its reaper), and the reaper's
# signals to the rank and what it left. The agent cutting its connection to the driver (``shutdown``, in agent/)
# ends its rank too.
_ENDS_A_RANK = {"abort", "_lost", "channel.close", "cancel", "terminate", "_terminate", "_end_everything_below"}


def rank_enders(runner: Path) -> dict[str, set[str]]:
    """Every function of the runner that ends a rank (``path: Class.function``), by the calls in its body that do."""

    def ends(function: ast.AST, in_agent: bool) -> set[str]:
        found = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "channel.close":
                found.add("channel.close")  # (the supervisor's clean-up steps name it, and call it later)
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name in _ENDS_A_RANK or (in_agent and name == "shutdown" and "SHUT_RDWR" in ast.unparse(node)):
                found.add(name)
        return found

    def functions(body: list[ast.stmt], prefix: str = "") -> list[tuple[str, ast.AST]]:
        found: list[tuple[str, ast.AST]] = []
        for node in body:
            if isinstance(node, ast.ClassDef):
                found += functions(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef):
                found.append((f"{prefix}{node.name}", node))
        return found

    enders = {}
    for path in sorted(runner.rglob("*.py")):
        where = str(path.relative_to(runner))
        for name, function in functions(ast.parse(path.read_text()).body):
            called = ends(function, where.startswith("agent/"))
            if called:
                enders[f"{where}: {name}"] = called
    return enders


def test_the_internals_table_of_who_ends_a_rank_names_every_function_that_does():
    """docs/internals.md's "Who ends a rank": each function it names exists and ends a rank, and none that ends
    one is left out (a new way to end a rank is a new row, with when and what the outcome then says)."""
    in_code = rank_enders(ROOT / "airflow_provider_hvd" / "runner")
    rows = markdown_table(ROOT / "docs" / "internals.md", "Who ends a rank")
    listed = [m.group(1) for row in rows if (m := re.fullmatch(r"`([\w/.]+\.py: [\w.]+)`", row[0]))]
    assert len(listed) == len(rows) >= 10 and all(len(row) == 3 for row in rows)  # who, when, what the outcome says
    assert len(listed) == len(set(listed)), sorted(name for name in listed if listed.count(name) > 1)
    missing = {name: sorted(calls) for name, calls in in_code.items() if name not in listed}
    assert not missing, f"functions that end a rank, missing from docs/internals.md's table: {missing}"
    assert not set(listed) - set(in_code), (
        f"docs/internals.md says these end a rank, and they do not (or are gone): {sorted(set(listed) - set(in_code))}"
    )


def test_the_internals_frame_table_lists_every_frame_kind():
    from airflow_provider_hvd.runner.shared.wire import Kind

    rows = markdown_table(ROOT / "docs" / "internals.md", "The wire protocol")
    listed = {(int(row[0]), row[1].strip("`")) for row in rows}
    assert listed == {(kind.value, kind.name) for kind in Kind}


_DIFFERENT_DEFAULT = re.compile(r"`(\w+)` \(default ([^);:]+)")
_DIFFERENT_ERROR = re.compile(r"`(\w+Error): ([^`]+)`")


def _different_rows() -> dict[str, str]:
    """The rows of docs/torch-distributor.md's "Different" table: its first cell -> this package's cell."""
    page = (ROOT / "docs" / "torch-distributor.md").read_text()
    table = page.split("## Different", 1)[1].split("\n\n", 2)[1]
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table.splitlines()[2:]]
    return {row[0]: row[2] for row in cells}


def _documented_value(text: str) -> object:
    text = text.strip().strip("`")
    if text.startswith("None"):
        return None
    if text.endswith(" s"):
        return float(text.removesuffix(" s"))
    if text.isdigit():
        return int(text)
    return text.strip('"')


def test_the_torch_distributor_differences_state_the_codes_defaults_and_refusals(monkeypatch):
    """Each default the "Different" table states is TorchDistributor's (and its operator's), and each refusal it
    quotes (`SomeError: message`, "..." for what varies) is what the code raises in that case."""
    import inspect

    from airflow_provider_hvd import TorchDistributor
    from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator
    from airflow_provider_hvd.runner.driver.launch.spark.cluster import existing_session

    def no_gpu_here() -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        assert existing_session() is None, "a SparkSession outlived its test module"
        TorchDistributor(2, local_mode=True, use_gpu=True)

    def cpu_run(train_object) -> None:
        TorchDistributor(1, local_mode=True, use_gpu=False).run(train_object)

    refusals = {
        "`use_gpu=True, local_mode=True` without a SparkSession": [no_gpu_here],
        "`num_processes` not a positive `int` (`2.0`, `True`)": [
            lambda: TorchDistributor(2.0),
            lambda: TorchDistributor(True),
        ],
        "arguments that do not fit the function": [lambda: cpu_run(lambda x: x)],
        "a file `train_object`": [lambda: cpu_run(str(ROOT / "no-such-train.py"))],
    }
    rows = _different_rows()
    stated = [
        (row, name, _documented_value(value))
        for row, cell in rows.items()
        for name, value in _DIFFERENT_DEFAULT.findall(cell)
    ]
    assert {name for _, name, _ in stated} >= {"driver_log_verbosity", "slot_wait_timeout", "stall_timeout"}
    for cls in (TorchDistributor, TorchDistributorOperator):
        parameters = inspect.signature(cls.__init__).parameters
        for row, name, value in stated:
            assert parameters[name].default == value, (cls.__name__, row, name, value)
    quoted = {row: _DIFFERENT_ERROR.findall(cell) for row, cell in rows.items() if _DIFFERENT_ERROR.search(cell)}
    assert set(quoted) == set(refusals), "a refusal the table quotes has no case here, or a case no row"
    for row, [(error, message)] in quoted.items():
        pattern = ".*".join(re.escape(part) for part in message.split("..."))
        for case in refusals[row]:
            with pytest.raises(Exception) as refused:  # noqa: PT011 - its type is the table's, checked below
                case()
            assert type(refused.value).__name__ == error and re.match(pattern, str(refused.value)), (row, refused.value)
