from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before pyspark or airflow is imported: loopback only, executors on this interpreter, Airflow on SQLite.
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("KERAS_BACKEND", "torch")
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="hvd-airflow-home-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
# the example DAGs and the tests' own, in one DAGs folder (dag.test() re-reads DAGs from it)
_DAGS = _AIRFLOW_HOME / "dags"
_DAGS.mkdir()
for _dag_file in [
    *Path(__file__).resolve().parent.parent.glob("dags/*.py"),
    *Path(__file__).resolve().parent.glob("dags/*.py"),
]:
    (_DAGS / _dag_file.name).symlink_to(_dag_file)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_DAGS)
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_AIRFLOW_HOME}/airflow.db"
# Every rank the tests start (local, on Spark, in the deployments: they inherit this environment) runs Horovod's
# background loop every 10 ms instead of every 1 ms: an idle rank then costs 3% of a core instead of 17%
# (measured here), and many tests' ranks wait (to be killed, cancelled, found stalled). A collective waits 10 ms
# at most for its cycle; nothing the tests check depends on it.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "10")

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "dags")]

import pytest  # noqa: E402
from jvm import use_lean_jvms  # noqa: E402
from spark_cluster import StandaloneCluster  # noqa: E402

use_lean_jvms()  # before any JVM starts: the suite's CPU goes mostly to starting JVMs


def pytest_unconfigure(config):
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


# --- pytest-xdist (`make test` runs the suite on several workers: docs/development.md) ---
# A worker takes whole modules (one SparkContext at a time; each module's fixtures start once), and starts the
# session-wide servers its modules use for itself. The modules that share the expensive ones share a worker, so
# that each server starts once or twice in a run, not on every worker:
# - "deployment": the real Airflow deployments (PostgreSQL, the standalone cluster, namespace hosts, the local
#   Connect server, MLflow) and the other MLflow modules (test_frameworks: the standalone cluster and MLflow);
# - "servers": the other modules on the standalone cluster and on the local Connect server.
# Workers take the groups in this order, then the other modules: the longest first, so that none starts last.
WORKER_GROUPS = {
    "deployment": [
        *("test_airflow_deployment", "test_long_runs_deployment", "test_mlflow", "test_mlflow_airflow"),
        "test_frameworks",
    ],
    "servers": [
        *("test_spark_connect", "test_connect_airflow", "test_driver_ports", "test_killed_ranks"),
        *("test_slot_wait", "test_standalone_cluster", "test_durable_runs", "test_restarts"),
    ],
    **{name: [name] for name in ("test_hosts", "test_gpus", "test_progress_writes", "test_stalls", "test_progress")},
    **{name: [name] for name in ("test_failures_on_spark", "test_run_guards", "test_torch_distributor")},
    "test_benchmarks": ["test_benchmarks"],  # each benchmark with a peer, once: 2-3 minutes
}
_GROUP_OF = {module: group for group, modules in WORKER_GROUPS.items() for module in modules}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules or groups of them to a worker, for any of xdist's load modes (its own --dist loadgroup marks
    a test's group in its node id, which pytest 9 no longer lets it change: the groups were lost)."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(Path(module).stem, module)

    config.option.loadscopereorder = False  # the collection's order, which workers give the groups' (below)
    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:  # every worker collects the same order: the order groups are given in
        rank = {group: i for i, group in enumerate(WORKER_GROUPS)}
        items.sort(key=lambda item: rank.get(_GROUP_OF.get(item.path.stem, ""), len(rank)))


_session_keys: set[str] = set()


def make_session(master: str, **conf: str):
    """A SparkSession with ``conf`` and nothing of the sessions made before it in this process's JVM."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._jvm is not None:  # a session's settings stay behind as the JVM's system properties
        for key in _session_keys:
            SparkContext._jvm.java.lang.System.clearProperty(key)
    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", **conf}
    _session_keys.update(settings)
    builder = SparkSession.builder.master(master).appName("hvd-tests")
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


@pytest.fixture(scope="module")
def spark_local():
    """A local[2] SparkSession (2 task slots), stopped at the end of the module: one SparkContext at a time."""
    spark = make_session("local[2]")
    yield spark
    spark.stop()


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory):
    """A master and 2 workers of 1 core on loopback, for every module that needs one (a slow start is waited
    for: other test runs may share the machine)."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone")).start(timeout=600)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real MLflow tracking server (tests/mlflow_server.py) for the session: its URL."""
    from mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def mlflow_auth_server(tmp_path_factory):
    """A real MLflow tracking server with MLflow's basic auth on (a request without its ``username`` and
    ``password`` gets 401), for the tests that need one: the ``MlflowServer``."""
    from mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-auth-server"), auth=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server (tests/postgres.py) for the real Airflow deployments' metadata databases: make each
    one's with ``postgres.create_database(name)``."""
    from postgres import PostgresServer

    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def connect_local(tmp_path_factory):
    """The ``sc://`` URL of a Spark Connect server on ``local[2]``, for the whole test session. Its application
    has Spark encrypt its traffic (the driver channel of its runs is TLS then): a local master needs no more
    for it. It takes messages of 32 MiB at most (a job too large for it is cheap to make). Make its sessions
    with ``connect_server.connect_session``."""
    from connect_server import ConnectServer

    settings = {
        "spark.network.crypto.enabled": "true",
        "spark.authenticate": "true",
        "spark.connect.grpc.maxInboundMessageSize": "32m",
    }
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect-local"), "local[2]", **settings).start().warm()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def connect_durable(request, tmp_path_factory):
    """The ``ConnectServer`` of a Spark Connect server on ``local[3]`` for a module of submitted runs: np=2 and the
    run's host (one more task slot); ``local[N]`` for a module that sets ``CONNECT_SLOTS = N`` (runs side by side).
    Its application encrypts its traffic (the run's link and channel are TLS)."""
    from connect_server import ConnectServer

    settings = {"spark.network.crypto.enabled": "true", "spark.authenticate": "true"}
    master = f"local[{getattr(request.module, 'CONNECT_SLOTS', 3)}]"
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect-durable"), master, **settings).start().warm()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def connect_standalone(standalone_cluster, tmp_path_factory):
    """The ``sc://`` URL of a Spark Connect server whose application runs on the standalone cluster's workers
    (both their cores while the module runs), stopped at the end of the module to free them. Its Spark UI is on
    (the free task slots are counted there)."""
    from connect_server import ConnectServer
    from spark_cluster import free_port

    server = ConnectServer(
        tmp_path_factory.mktemp("spark-connect-standalone"),
        standalone_cluster.url,
        **{
            **standalone_cluster.app_conf,
            "spark.cores.max": "2",
            "spark.executor.memory": "1g",
            "spark.ui.enabled": "true",
            "spark.ui.port": str(free_port()),
        },
    ).start()
    yield server.url
    server.stop()


@pytest.fixture
def pid_dir(tmp_path) -> str:
    path = tmp_path / "pids"
    path.mkdir()
    return str(path)


# For the modules that run DAGs with dag.test() (pytestmark = pytest.mark.usefixtures("airflow_db",
# "spark_default_local")); tests/dag_runs.py has what else they share.


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata database (SQLite, in the tests' Airflow home), migrated once for the test process."""
    import subprocess

    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)


@pytest.fixture
def spark_default_local(monkeypatch, caplog):
    """``spark_default`` on ``local[2]``, and the provider's log lines captured."""
    import logging

    from dag_runs import LOCAL2

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL2)
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")


@pytest.fixture(scope="module")
def dags():
    """The DAGs folder's DAGs (the example DAGs and tests/dags/), parsed without an import error."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    assert not bag.import_errors
    return bag.dags
