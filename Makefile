# `make demo` and `make test` work from a fresh clone: they create .venv, install the pinned versions,
# build horovod once (cached under ~/.cache/airflow-provider-hvd) and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.chromium
# the MLflow tracking server the tests start: full MLflow with its basic-auth app (mlflow[auth]), whose pins
# (pyarrow<26, cachetools<8) are not the project's
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
AIRFLOW_HOME ?= $(CURDIR)/airflow_home
export SPARK_LOCAL_IP ?= 127.0.0.1
export PYSPARK_PYTHON := $(CURDIR)/$(PY)
export KERAS_BACKEND ?= torch

.PHONY: setup test check docs demo airflow bench docker-check clean

# The venv, Chromium and the MLflow server's venv are independent: they install at once (mostly downloads and
# unpacking, each of which leaves a core idle).
setup:
	@$(MAKE) --no-print-directory -j3 $(STAMP) $(BROWSER_STAMP) $(MLFLOW_STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/install_horovod.py scripts/check_prereqs.sh
	scripts/check_prereqs.sh $(PYTHON)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel packaging
	@# the frameworks first: horovod is built against them (PyTorch and TensorFlow in one wheel)
	$(PIP) install torch==2.13.0 tensorflow==2.21.0 tf-keras==2.21.0
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) scripts/install_horovod.py
	$(PIP) install -e '.[horovod,airflow,torch,keras,tensorflow,transformers,lightning,mlflow,openlineage,dev,docs]'
	@# pyspark-client (needed by the apache-spark provider) overwrites pyspark's Python files with its own
	@# older ones; pyspark must win, or the Python side and the JVM side of Spark differ.
	$(PY) -c "import pyspark, sys; sys.exit(pyspark.__version__ != '4.3.0')" \
	  || $(PIP) install --force-reinstall --no-deps pyspark==4.3.0
	touch $(STAMP)

$(MLFLOW_STAMP): constraints-mlflow-server.txt
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints-mlflow-server.txt $(MLFLOW_VENV)/bin/python -m pip --disable-pip-version-check -q \
	  install 'mlflow[auth]'
	touch $(MLFLOW_STAMP)

$(BROWSER_STAMP): scripts/install_chromium.sh
	mkdir -p $(VENV)
	scripts/install_chromium.sh
	touch $(BROWSER_STAMP)

# The suite on pytest-xdist workers, whole modules to a worker, the modules that share a server together
# (tests/conftest.py: WORKER_GROUPS); 2 for 2 cores, measured (docs/development.md)
TEST_WORKERS ?= 2
test: setup
	$(MAKE) --no-print-directory check
	$(PY) -m pytest -ra -n $(TEST_WORKERS)

# The linter, the formatter's check and the type checker (strict on the core runner), then the docs.
check: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(MAKE) --no-print-directory docs

# The documentation site, in strict mode: a warning, a broken link or an unresolved reference fails it
# (not with --quiet, which hides the warnings that strict mode counts).
docs: setup
	$(PY) -m mkdocs build --strict

demo: setup
	AIRFLOW_HOME=$(AIRFLOW_HOME) scripts/demo.sh $(PY)

# Airflow's UI with the example DAGs and their Training tab, on SQLite in $(AIRFLOW_HOME) and local[*] Spark, until
# Ctrl-C (scripts/local_airflow.py; docs/guide/provider.md)
AIRFLOW_PORT ?= 8080
airflow: setup
	AIRFLOW_HOME=$(AIRFLOW_HOME) $(PY) scripts/local_airflow.py --port $(AIRFLOW_PORT)

bench: setup
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/logs.py
	$(PY) benchmarks/payload.py
	$(PY) benchmarks/scale.py
	$(PY) benchmarks/torch_launch.py
	$(PY) benchmarks/result_memory.py
	$(PY) benchmarks/connect_launch.py
	$(PY) benchmarks/durable_launch.py
	$(PY) benchmarks/durable_retry.py

# docker/ built and run for real with Docker or podman (docs/docker.md); 20-40 minutes on 2 cores, so not in `test`
docker-check:
	scripts/docker_check.sh

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) $(AIRFLOW_HOME) .pytest_cache spark-warehouse site
