"""Every code block of the README and docs/ that a user would paste runs as written (tests/snippets.py says which,
and how). The python blocks run in this process on the suite's Spark: ``local[2]`` (the pages' ``getOrCreate()``
finds it) and the Spark Connect server ``connect_local`` (``local[*]`` on 2 cores, as ``start-connect-server.sh``
starts one), whose port replaces the docs' ``localhost:15002``'s."""

from __future__ import annotations

import re
import subprocess
from itertools import groupby

import pytest
from snippets import ROOT, airflow_commands, all_blocks, exported, run_page

DOCS_SERVER = "localhost:15002"


def test_every_block_is_code_and_says_why_it_does_not_run():
    """Each python block compiles and each bash block parses; a python block that does not run says why (a
    fragment, a template, what it needs that a test cannot have)."""
    found = all_blocks()
    assert len(found) > 40, len(found)
    for block in found:
        if block.language == "python":
            compile(block.code, block.where, "exec")
        else:
            parsed = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
            assert parsed.returncode == 0, f"{block.where}: {parsed.stderr}"
        assert block.not_run != "", f"{block.where}: say why the block does not run"


def test_the_shell_blocks_name_airflow_commands_settings_and_dags_that_exist():
    """The shell blocks are not run (they start Airflow or need a cluster): what they name is looked up. Each
    ``airflow`` command is one of Airflow's, each ``AIRFLOW__SECTION__KEY`` one of its settings, each
    ``AIRFLOW_CONN_...`` a connection Airflow reads, each DAG one of dags/; a block that runs ``airflow dags
    test`` makes the database and names the DAGs folder first."""
    from airflow.cli.cli_config import GroupCommand, core_commands
    from airflow.configuration import conf
    from airflow.models.connection import Connection

    groups = {
        group.name: {sub.name for sub in group.subcommands}
        for group in core_commands
        if isinstance(group, GroupCommand)
    }
    dag_files = "\n".join(path.read_text() for path in (ROOT / "dags").glob("*.py"))
    blocks = [block for block in all_blocks() if block.language == "bash"]
    for block in blocks:
        commands = airflow_commands(block.code)
        for command in commands:
            group, sub = [*command, "", ""][1:3]
            assert group in groups and sub in groups[group], f"{block.where}: no command `{' '.join(command[:3])}`"
            if group == "dags" and sub in ("test", "trigger", "unpause"):
                dag_id = command[3]
                assert re.search(rf"[\"']{dag_id}[\"']|def {dag_id}\(", dag_files), f"{block.where}: no DAG {dag_id}"
        variables = exported(block.code)
        for name, value in variables.items():
            if name.startswith("AIRFLOW__"):
                section, _, key = name.removeprefix("AIRFLOW__").partition("__")
                assert conf.has_option(section.lower(), key.lower()), f"{block.where}: Airflow has no setting {name}"
            elif name.startswith("AIRFLOW_CONN_"):
                conn_id = name.removeprefix("AIRFLOW_CONN_").lower()
                made = Connection.from_json(value, conn_id) if value.startswith("{") else Connection(conn_id, uri=value)
                assert made.conn_type in ("spark", "spark_connect"), f"{block.where}: {name}: {made.conn_type}"
        if any(command[1:3] == ["dags", "test"] for command in commands):
            assert commands[0][1:3] == ["db", "migrate"], f"{block.where}: `airflow dags test` needs the database"
            assert "AIRFLOW__CORE__DAGS_FOLDER" in variables, f"{block.where}: which DAGs folder?"
    assert sum(len(airflow_commands(block.code)) for block in blocks) >= 5


@pytest.mark.timeout(300)  # (a block that hangs: the failure names the test; its stack is in the output)
def test_the_python_blocks_run_as_written(spark_local, connect_local, tmp_path, monkeypatch):
    """Each page's blocks in order in one namespace, as pasted top to bottom; the pages on Spark Connect last,
    their session stopped after (it would be the next runs' active one). A block's own files are made in a
    folder of its own."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    monkeypatch.chdir(tmp_path)
    unique = {}  # (the README's first example is also the docs' front page's and the runner guide's)
    for block in all_blocks():
        if block.runs:
            unique.setdefault(block.code, block)
    on_connect = {block.page for block in unique.values() if "sc://" in block.code}
    ordered = sorted(unique.values(), key=lambda block: block.page in on_connect)
    replace = {DOCS_SERVER: f"localhost:{connect_local.rsplit(':', 1)[1]}"}
    failures = []
    try:
        for _, page_blocks in groupby(ordered, key=lambda block: block.page):
            failures += run_page(list(page_blocks), replace)
    finally:
        connect = ConnectSession.getActiveSession()
        if connect is not None:
            connect.stop()
    assert len(unique) >= 8, sorted(block.where for block in unique.values())
    assert not failures, "\n\n".join(failures)
