"""docker/ as far as it can be checked without a Docker engine: the compose file against the Compose
Specification's JSON schema, its layout, and the Dockerfile (parsed with BuildKit's own parser)."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import dockerfile
import jsonschema
import pytest
import yaml
from airflow.sdk import Connection

from airflow_provider_hvd.hooks.horovod import master_from_connection

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "docker-compose.yml"
AIRFLOW_SERVICES = ["airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def instructions() -> list:
    return list(dockerfile.parse_file(str(ROOT / "docker" / "Dockerfile")))


def test_the_compose_file_follows_the_compose_specification(compose, validator):
    assert [error.message for error in validator.iter_errors(compose)] == []


def test_the_schema_check_catches_a_mistake(compose, validator):
    broken = copy.deepcopy(compose)
    broken["services"]["spark-master"]["healthcheck"]["retry"] = 5  # "retries"
    assert not validator.is_valid(broken)


def test_one_image_is_built_once_and_used_by_every_service(compose):
    services = compose["services"]
    builders = {name: s for name, s in services.items() if "build" in s}
    assert list(builders) == ["airflow-init"]  # several builders of one tag race on a first `up --build`
    build = builders["airflow-init"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == ROOT / "docker" / "Dockerfile"
    image = builders["airflow-init"]["image"]
    users = {name for name, s in services.items() if s.get("image") == image}
    assert users == set(services) - {"postgres"}
    assert {services[name]["pull_policy"] for name in users - {"airflow-init"}} == {"never"}


def test_airflow_is_laid_out_as_its_official_compose_file(compose):
    services = compose["services"]
    assert {"postgres", "airflow-init", *AIRFLOW_SERVICES} <= set(services)
    for name in ["postgres", *AIRFLOW_SERVICES, "spark-master", "spark-worker-1", "spark-worker-2"]:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in AIRFLOW_SERVICES:
        assert services[name]["depends_on"]["airflow-init"] == {"condition": "service_completed_successfully"}
        assert services[name]["depends_on"]["postgres"] == {"condition": "service_healthy"}
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
        assert "AIRFLOW__API_AUTH__JWT_SECRET" in env  # shared by whoever signs and checks task tokens
    assert services["airflow-apiserver"]["ports"] == ["8080:8080"]
    init = " ".join(services["airflow-init"]["command"])
    assert "airflow db migrate" in init and "passwords.json" in init  # the admin's password, written down


def with_defaults(text: str) -> str:
    """``text`` as Compose interpolates it when no variable is set (``${NAME:-default}`` → ``default``)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def spark_connection(services: dict) -> tuple[str, dict[str, str]]:
    env = services["airflow-scheduler"]["environment"]
    return master_from_connection(
        Connection.from_json(with_defaults(env["AIRFLOW_CONN_SPARK_DEFAULT"]), conn_id="spark_default")
    )


def test_the_executors_can_reach_the_driver_and_the_link_its_master(compose):
    services = compose["services"]
    # tasks, so Spark drivers, run in the scheduler
    assert services["airflow-scheduler"]["environment"]["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    master, conf = spark_connection(services)
    assert conf["spark.driver.host"] == services["airflow-scheduler"]["hostname"]
    master_cmd = shlex.split(services["spark-master"]["command"])
    option = dict(zip(master_cmd[2::2], master_cmd[3::2], strict=True))
    assert master == f"spark://{option['--host']}:{option['--port']}"
    assert conf["spark.horovodRunner.masterWebUiUrl"] == f"http://{option['--host']}:{option['--webui-port']}"
    for worker in ("spark-worker-1", "spark-worker-2"):
        assert master in shlex.split(services[worker]["command"])


def published_ports(service: dict) -> set[int]:
    """The container ports ``service`` publishes on the same host ports (short syntax, ranges expanded)."""
    ports = set()
    for entry in service.get("ports", []):
        host, container = str(entry).split("/")[0].rsplit(":", 2)[-2:]
        assert host == container, f"{entry}: the executors are told the driver's own port numbers"
        first, _, last = container.partition("-")
        ports.update(range(int(first), int(last or first) + 1))
    return ports


def test_the_driver_listens_on_every_interface_at_fixed_ports_that_are_published(compose):
    services = compose["services"]
    _, conf = spark_connection(services)
    assert conf["spark.driver.bindAddress"] == "0.0.0.0"
    keys = [
        "spark.driver.port",
        "spark.driver.blockManager.port",
        "spark.horovodRunner.channelPort",
        "spark.horovodRunner.rendezvousPort",
    ]
    ports = [int(conf[key]) for key in keys]
    assert len(set(ports)) == len(keys) and all(ports)
    assert published_ports(services["airflow-scheduler"]) == set(ports)
    text = services["airflow-scheduler"]["environment"]["AIRFLOW_CONN_SPARK_DEFAULT"]
    assert '"spark.driver.host": "${SPARK_DRIVER_HOST:-airflow-scheduler}"' in text  # settable for outside executors


def test_the_dockerfile_installs_horovod_through_the_makefiles_script(instructions):
    script = "install_horovod.py"
    runs = [i.original for i in instructions if i.cmd == "RUN"]
    assert any(re.search(rf"python {script}\b", run) for run in runs), runs
    copies = [i.value for i in instructions if i.cmd == "COPY"]
    assert any(f"scripts/{script}" in value for value in copies)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"\$\(PY\) scripts/{script}\b", makefile)


def test_the_dockerfile_has_no_amd64_paths_and_dependencies_before_the_source(instructions):
    text = "\n".join(i.original for i in instructions)  # not the comments
    assert "amd64" not in text and "/usr/lib/jvm/" not in text
    env = [i.value for i in instructions if i.cmd == "ENV"]
    pairs = [pair for value in env for pair in zip(value[::2], value[1::2], strict=False)]
    assert ("JAVA_HOME", "/opt/java") in pairs
    source = next(n for n, i in enumerate(instructions) if i.cmd == "COPY" and i.value[0] == ".")
    dependencies = [
        n
        for n, i in enumerate(instructions)
        if i.cmd == "RUN" and "pip install" in i.original and "/opt/airflow-provider-hvd" not in i.original
    ]
    assert dependencies and max(dependencies) < source
    for i in instructions:  # what the Dockerfile copies is in the repository and in the build context
        if i.cmd == "COPY" and not any(f.startswith("--from") for f in i.flags):
            for path in i.value[:-1]:
                assert (ROOT / path).exists(), path


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "airflow_home"} <= ignored


def test_torch_comes_from_an_index_or_a_wheel_directory_given_at_build_time(instructions):
    args = dict(i.value[0].split("=", 1) for i in instructions if i.cmd == "ARG" and "=" in i.value[0])
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"  # what a user with internet wants
    stages = [i.value for i in instructions if i.cmd == "FROM"]
    assert ("scratch", "AS", "torch-wheels") in stages  # empty unless --build-context torch-wheels=DIR
    torch_run = next(i for i in instructions if i.cmd == "RUN" and "torch==" in i.original)
    assert "--mount=type=bind,from=torch-wheels,target=/torch-wheels" in torch_run.flags
    assert "--find-links /torch-wheels" in torch_run.original
    assert '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in torch_run.original  # empty: no index at all


def test_tensorflow_is_a_build_argument_off_by_default(instructions):
    args = [i.value[0] for i in instructions if i.cmd == "ARG"]
    assert "TENSORFLOW=false" in args
    runs = [i.original for i in instructions if i.cmd == "RUN"]
    tf = next(n for n, run in enumerate(runs) if "requirements_of.py tensorflow" in run)
    horovod = next(n for n, run in enumerate(runs) if "install_horovod.py" in run)
    assert tf < horovod  # horovod is built against the TensorFlow already installed


def test_requirements_of_lists_the_core_and_the_extras(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("requirements_of", ROOT / "scripts" / "requirements_of.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--core", "airflow", "--pyproject", str(ROOT / "pyproject.toml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("cloudpickle") for line in lines)  # the core
    assert any(line.startswith("apache-airflow>=") for line in lines)  # the extra asked for
    assert not any(line.startswith("horovod") for line in lines)  # an extra not asked for: install_horovod.py's
    with pytest.raises(SystemExit, match="no extra nonesuch in"):
        module.main(["nonesuch", "--pyproject", str(ROOT / "pyproject.toml")])


def test_the_check_script_is_a_make_target():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^docker-check:\n\tscripts/docker_check\.sh$", makefile, re.M)


def test_the_connect_server_runs_on_the_cluster_with_room_for_a_durable_run_beside_the_classic_jobs(compose, dags):
    """spark_connect_default points at the compose file's Connect server, whose application leaves the classic
    jobs their cores, and has 2 ranks and the run's host for the example DAG that trains durably there."""
    services = compose["services"]
    env = services["airflow-scheduler"]["environment"]
    conn = Connection(conn_id="spark_connect_default", **json.loads(env["AIRFLOW_CONN_SPARK_CONNECT_DEFAULT"]))
    assert conn.conn_type == "spark_connect" and conn.host == f"sc://{services['spark-connect']['hostname']}"
    command = shlex.split(services["spark-connect"]["command"])
    assert command[:3] == ["spark-submit", "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    option = dict(zip(command[3::2], command[4::2], strict=True))
    conf = dict(value.split("=", 1) for key, value in zip(command[3::2], command[4::2], strict=True) if key == "--conf")
    assert option["--master"] == "spark://spark-master:7077"
    assert int(conf["spark.connect.grpc.binding.port"]) == conn.port and published_ports(services["spark-connect"]) == {
        conn.port
    }
    workers = ("spark-worker-1", "spark-worker-2")
    worker_cores = [
        int(dict(zip(cmd[3::2], cmd[4::2], strict=True))["--cores"])
        for cmd in (shlex.split(services[w]["command"]) for w in workers)
    ]
    ranks = dags["torch_durable_example"].get_task("train").num_processes
    connect_cores = int(conf["spark.cores.max"])
    assert connect_cores // int(conf["spark.executor.cores"]) >= ranks + 1  # the ranks and the run's host
    # the master spreads the server's executors evenly over the workers, registered before it starts: each keeps
    # one core for the classic jobs, so that horovod_train_example's 2 ranks run one on each
    assert all(services["spark-connect"]["depends_on"][w] == {"condition": "service_healthy"} for w in workers)
    assert connect_cores % len(workers) == 0
    assert [cores - connect_cores // len(workers) for cores in worker_cores] == [1, 1]
    assert dags["torch_durable_example"].get_task("train").conn_id == "spark_connect_default"
